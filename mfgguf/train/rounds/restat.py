"""Forward-only passes on a merged trunk: an expert's router statistics and held-out losses, the trunk's.

Merging the experts' shared copies (`mfgguf sync`) changes the vectors every FFN and the router
see, so the statistics an expert recorded against its private trunk copy no longer describe the
model that assembly writes. `restat_expert` recomputes them on merged trunk + that expert: the
same sample of the expert's shard that training used (4 x eval_tokens), no gradients, one expert
in memory. Held-out losses are recomputed too, so the oracle and the reports describe the merged
model.

Example:
    >>> tensors, meta = restat_expert(RunDir("RUN"), 1, read_module(rd, 1), merged_trunk_path, cfg, "cpu")
"""

from __future__ import annotations

from pathlib import Path

import torch

import time

from mfgguf.config import ModelConfig
from mfgguf.errors import MfggufError
from mfgguf.run import RunDir, current_trunk, module_name, read_module, write_module
from mfgguf.run.records import ModuleMeta
from mfgguf.train.experts.expert import build_expert_model
from mfgguf.train.engine.loop import evaluate, validation_losses, load_tokens, mean, resolve_device
from mfgguf.train.experts.stats import RouterStats, stats_tokens
from mfgguf.train.engine.weights import read_safetensors, trunk_alone


def needs_restat(rd: RunDir, trunk: ModuleMeta | dict, i: int) -> bool:
    """Expert i still holds statistics from before the final sync (it trained against the trunk that
    the final trunk was merged from)."""
    trunk = ModuleMeta.of(trunk)
    if not trunk.final or not rd.module_meta(i).is_file():
        return False
    m = read_module(rd, i)
    return m.trunk_sha256 == trunk.synced_from and not m.shared_merged


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
    trunk = current_trunk(rd)
    meta = read_module(rd, i)
    if not trunk.final:
        raise MfggufError(f"{rd.root}'s trunk is not final: run `mfgguf sync {rd.root}` after the experts' last round first")
    if meta.trunk_sha256 == trunk.sha256 and meta.shared_merged:
        return {**meta.to_json(), "restated": False}
    if not needs_restat(rd, trunk, i):
        raise MfggufError(f"{module_name(i)} was not trained against the trunk the final sync merged; retrain it")
    cfg = ModelConfig.from_dict(trunk.config)
    tensors, extra = restat_expert(rd, i, meta, rd.module_file(0), cfg, device, pooled)
    out = write_module(rd, i, tensors, {**meta.to_json(), **extra, "restat_s": time.perf_counter() - t0,
                                        "trunk_sha256": trunk.sha256, "shared_merged": True})
    return {**out, "restated": True}


def precision_of(meta: ModuleMeta | dict) -> str:
    """The precision a module trained in (bf16 or fp32), for forward passes that must match it."""
    p = ModuleMeta.of(meta).precision
    return p if p in ("bf16", "fp32") else "fp32"


@torch.no_grad()
def restat_expert(rd: RunDir, i: int, meta: ModuleMeta | dict, trunk_path: Path, cfg: ModelConfig, device: str = "cpu",
                  pooled: RouterStats | None = None):
    """(module tensors: FFN + router means, metadata updates) of expert i on the trunk at `trunk_path`."""
    dev = resolve_device(device)
    meta = ModuleMeta.of(meta)
    prec = precision_of(meta)
    model = build_expert_model(rd, cfg, 0, dev, bf16_trunk=prec == "bf16", trunk_path=trunk_path)
    ffn = {k: t for k, t in read_safetensors(rd.module_file(i)) if k.startswith("blk.")}
    model.load_expert(ffn)
    tc, eval_tokens = meta.train, meta.eval_tokens
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
        "premerge": meta.premerge(),
    }
    means = {k: v for k, v in stats.tensors().items() if k.endswith(".mean")}  # the module keeps its means only
    return {**model.expert_tensors(0), **means}, extra


@torch.no_grad()
def trunk_validation_loss(rd: RunDir, trunk_path: Path, trunk_meta: ModuleMeta | dict, device: str = "cpu",
                          scoring: tuple[int, str] | None = None) -> dict:
    """{domain: validation loss} of the trunk alone (anchor, + its seed FFN if it has one) read from `trunk_path`,
    over `scoring` = (validation tokens a domain, precision); default trunk_scoring(trunk_meta)."""
    dev = resolve_device(device)
    model, route = trunk_alone(trunk_path, ModelConfig.from_dict(ModuleMeta.of(trunk_meta).config), dev)
    eval_tokens, precision = scoring or trunk_scoring(trunk_meta)
    return validation_losses(rd.validation_dir, model, eval_tokens, route, dev, precision)


def trunk_scoring(trunk_meta: ModuleMeta | dict, experts: list = ()) -> tuple[int, str]:
    """(validation tokens a domain, precision) the trunk is scored with. A trunk trained here: as it scored
    itself. An imported base never trained here: its own settings (65,536 tokens a domain, fp32) made
    most of a sync's time on SmolLM2 (docs/sync-rounds.md), so it is scored as its `experts` (their metadata) score themselves:
    their validation tokens, their precision."""
    trunk, experts = ModuleMeta.of(trunk_meta), [ModuleMeta.of(m) for m in experts]
    if trunk.source == "base" and experts:
        return max(m.eval_tokens for m in experts), precision_of(experts[0])
    return trunk.eval_tokens, precision_of(trunk)

