"""Forward-only passes on a merged trunk: an expert's router statistics and held-out losses, the trunk's.

Merging the experts' shared copies (`mfgguf sync`) changes the vectors every FFN and the router
see, so the statistics an expert recorded against its private trunk copy no longer describe the
model that assembly writes. `restat_expert` recomputes them on merged trunk + that expert: the
same sample of the expert's shard that training used (4 x eval_tokens), no gradients, one expert
in memory. Held-out losses are recomputed too, so the oracle and the reports describe the merged
model.

Example:
    >>> tensors, meta = restat_expert(RunDir("RUN"), 1, read_module_meta(rd, 1), merged_trunk_path, cfg, "cpu")
"""

from __future__ import annotations

from pathlib import Path

import torch

import time

from mfgguf.config import ModelConfig
from mfgguf.errors import MfggufError
from mfgguf.run import RunDir, module_name, read_module_meta, write_module
from mfgguf.train.experts.expert import build_expert_model, load_trunk_meta
from mfgguf.train.engine.loop import evaluate, validation_losses, load_tokens, mean, resolve_device
from mfgguf.train.experts.stats import RouterStats, stats_tokens
from mfgguf.train.engine.weights import read_safetensors, trunk_alone


def needs_restat(rd: RunDir, trunk: dict, i: int) -> bool:
    """Expert i still holds statistics from before the final sync (it trained against the trunk that
    the final trunk was merged from)."""
    if not trunk.get("final") or not rd.module_meta(i).is_file():
        return False
    m = read_module_meta(rd, i)
    return m.get("trunk_sha256") == trunk.get("synced_from") and not m.get("shared_merged")


def restat(run: Path, expert: int, *, device: str = "cpu", pooled: RouterStats | None = None) -> dict:
    """Recompute expert EXPERT's router statistics on the final merged trunk (after the last `mfgguf sync`).

    Forward only, trunk + this one expert in memory, over the sample of its shard that training
    used; its held-out losses are recomputed too. Rewrites its module file with its FFNs and the
    new statistics against the merged trunk (its shared copies live in that trunk now; the files
    before are kept in RUN/rounds/sync_<k>/before). One process per expert, on any machine, in
    any order; an expert already done is left alone. `pooled` (a RouterStats with second moments)
    also receives this pass's statistics, so `sync` pools the router's G without a second pass.

    Example:
        >>> restat(Path("RUN"), 3)["restated"]
        True
    """
    t0 = time.perf_counter()
    rd = RunDir(run)
    i = rd.check_expert_index(int(expert))
    trunk = load_trunk_meta(rd)
    meta = read_module_meta(rd, i)
    if not trunk.get("final"):
        raise MfggufError(f"{rd.root}'s trunk is not final: run `mfgguf sync {rd.root}` after the experts' last round first")
    if meta.get("trunk_sha256") == trunk["sha256"] and meta.get("shared_merged"):
        return {**meta, "restated": False}
    if not needs_restat(rd, trunk, i):
        raise MfggufError(f"{module_name(i)} was not trained against the trunk the final sync merged; retrain it")
    cfg = ModelConfig.from_dict(trunk["config"])
    tensors, extra = restat_expert(rd, i, meta, rd.module_file(0), cfg, device, pooled)
    extra["restat_s"] = time.perf_counter() - t0
    out = write_module(rd, i, tensors, {**meta, **extra, "trunk_sha256": trunk["sha256"], "shared_merged": True})
    return {**out, "restated": True}


def precision_of(meta: dict) -> str:
    """The precision a module trained in (bf16 or fp32), for forward passes that must match it."""
    return meta.get("precision") if meta.get("precision") in ("bf16", "fp32") else "fp32"


@torch.no_grad()
def restat_expert(rd: RunDir, i: int, meta: dict, trunk_path: Path, cfg: ModelConfig, device: str = "cpu",
                  pooled: RouterStats | None = None):
    """(module tensors: FFN + router means, metadata updates) of expert i on the trunk at `trunk_path`."""
    dev = resolve_device(device)
    prec = precision_of(meta)
    model = build_expert_model(rd, cfg, 0, dev, bf16_trunk=prec == "bf16", trunk_path=trunk_path)
    ffn = {k: t for k, t in read_safetensors(rd.module_file(i)) if k.startswith("blk.")}
    model.load_expert(ffn)
    tc = meta.get("train", {})
    eval_tokens = int(tc.get("eval_tokens", 65_536))
    stats = RouterStats(cfg.n_layers, cfg.dim, second_moment=pooled is not None)
    shard_loss, n_stats = evaluate(model, load_tokens(rd.shard(i), f"shard {i}"), stats_tokens(tc), "single", dev, prec,
                                   hook=stats.hook)
    if pooled is not None:
        pooled.add(stats)
    held = validation_losses(rd.validation_dir, model, eval_tokens, "single", dev, prec)
    extra = {
        "router_stats_count": stats.n, "router_stats_on": "merged trunk", "shard_loss": shard_loss,
        # forward passes this module cost beyond its training steps: the comparison's FLOPs count them (flops.py)
        "restat_tokens": int(n_stats) + sum(min(len(load_tokens(f, f.stem)), eval_tokens)
                                            for f in sorted(rd.validation_dir.glob("*.npy"))),
        "validation_loss": held, "validation_loss_mean": mean(held),
        "premerge": {k: meta.get(k) for k in ("validation_loss", "validation_loss_mean", "shard_loss", "trunk_sha256")},
    }
    means = {k: v for k, v in stats.tensors().items() if k.endswith(".mean")}  # the module keeps its means only
    return {**model.expert_tensors(0), **means}, extra


@torch.no_grad()
def trunk_validation_loss(rd: RunDir, trunk_path: Path, trunk_meta: dict, device: str = "cpu",
                  scoring: tuple[int, str] | None = None) -> dict:
    """{domain: held-out loss} of the trunk alone (anchor, + its seed FFN if it has one) read from `trunk_path`,
    over `scoring` = (held-out tokens a domain, precision); default trunk_scoring(trunk_meta)."""
    dev = resolve_device(device)
    model, route = trunk_alone(trunk_path, ModelConfig.from_dict(trunk_meta["config"]), dev)
    eval_tokens, precision = scoring or trunk_scoring(trunk_meta)
    return validation_losses(rd.validation_dir, model, eval_tokens, route, dev, precision)


def trunk_scoring(trunk_meta: dict, experts: list[dict] = ()) -> tuple[int, str]:
    """(held-out tokens a domain, precision) the trunk is scored with. A trunk trained here: as it scored
    itself. An imported base never trained here: its own settings (65,536 tokens a domain, fp32) made
    most of a sync's time on SmolLM2 (docs/sync-rounds.md), so it is scored as its `experts` (their metadata) score themselves:
    their held-out tokens, their precision."""
    eval_tokens = int(trunk_meta.get("train", {}).get("eval_tokens", 65_536))
    if trunk_meta.get("source") == "base" and experts:
        return max(int(m.get("train", {}).get("eval_tokens", eval_tokens)) for m in experts), precision_of(experts[0])
    return eval_tokens, precision_of(trunk_meta)

