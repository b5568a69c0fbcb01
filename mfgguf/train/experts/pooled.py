"""The router's pooled second moment: one file per run instead of one dim x dim matrix in every expert.

Ridge routing needs, per layer, each expert's mean FFN input (dim,), which experts keep recording,
and G, the second moment of the FFN inputs over the union of the shards (dim x dim). Module format
1 stored each expert's own second moment M_i: for the `1b` preset 50 MB per expert, more than the
expert's weights, read and hashed at every assembly. `pool_router_stats` computes
G = sum_i n_i M_i / sum_i n_i once. Each M_i is the one expert i's training recorded where it did
(its last steps' FFN inputs, the ones its means come from: tailstats.py, a file beside the module named
by its sha256), read in a moment; otherwise (an expert trained with `--stats-from pass`, or by an
earlier version, or `--forward-pass`) it is measured with the statistics restat.py measures,
layer-streamed (stats_pass.py: one layer of trunk + expert in memory, no head), over the same sample of
the expert's shard that its training measured (4 x that expert's eval_tokens, windows spread over the
shard), experts one after another: the very G that format 1 pooled at assembly. The pass was half of
`assemble` on the README's run (docs/base-model.md); how the recorded moments route: docs/studies/routing.md.

Output: modules/router_stats.safetensors (`router_stats.blk.{l}.second_moment`, f32) and its JSON,
recorded in the manifest with their hashes; the JSON names the trunk and every expert (sha256) it
was computed with, so assembly never uses statistics that predate a retrained module: it runs this
pass again first (converters/plan/ensure_stats.py).

Example:
    >>> pool_router_stats(Path("RUN"))["router_stats_count"]
    786432
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch

from mfgguf.config import ModelConfig
from mfgguf.errors import MfggufError
from mfgguf.run.records import ModuleMeta
from mfgguf.run import RunDir, current_trunk, module_name, read_module, trained_expert, write_router_stats
from mfgguf.train.engine.loop import load_tokens, resolve_device
from mfgguf.train.rounds.restat import precision_of
from mfgguf.train.experts.stats import RouterStats, stats_tokens
from mfgguf.train.experts.stats_pass import stream_stats
from mfgguf.train.experts.tailstats import read_moments


@torch.no_grad()
def pool_router_stats(run: Path, *, tokens: int | None = None, device: str = "cpu",
                      progress: bool = True, experts: list[int] | None = None, forward_pass: bool = False) -> dict:
    """Compute the router's pooled statistics of RUN (modules/router_stats.safetensors), which assembly
    needs for the ridge router: the second moment of the FFN inputs over every expert's shard, from
    trunk + that expert (forward only, one expert in memory at a time). Run it after the experts are
    trained, and again after retraining one (`train-experts`, the final `sync` and `assemble`, where
    they are missing or stale, do it for you).
    --experts I,J pools over those experts only (the ones an assembly of a subset takes).
    An expert whose training recorded its second moments gives those, unless --tokens or --forward-pass
    asks for a forward pass over every expert's shard.

    Example:
        >>> pool_router_stats(Path("RUN"))["experts"]
        {'expert_001': '3f2a...', ...}
    """
    t0 = time.perf_counter()
    rd = RunDir(run)
    info = rd.run_info()
    trunk = current_trunk(rd)
    cfg = ModelConfig.from_dict(trunk.config)
    dev = resolve_device(device)
    stats = RouterStats(cfg.n_layers, cfg.dim, second_moment=True)
    ids = range(1, info.n_experts + 1) if experts is None else [rd.check_expert_index(int(i)) for i in experts]
    if not ids:
        raise MfggufError("no experts to pool router statistics over; pass --experts with at least one")
    metas = {i: _Brief.of(trained_expert(rd, trunk.sha256, i, "mfgguf router-stats")) for i in ids}
    prec = next(iter(metas.values())).precision
    recorded = 0
    with _Bar(len(metas), progress) as bar:
        for i in metas:
            bar.update(module_name(i))
            own = None if tokens or forward_pass else read_moments(rd, i, metas[i].sha256, cfg.n_layers, cfg.dim)
            if own is not None:  # the moments its last training steps recorded
                stats.add(own)
                recorded += 1
            else:
                n = int(tokens or metas[i].stats_tokens)  # the sample the expert's own statistics measured
                stream_stats(cfg, rd.module_file(0), load_tokens(rd.shard(i), f"shard {i}"), n, stats.hook,
                             expert_path=rd.module_file(i), dev=dev, precision=prec)
            bar.advance()
    per = int(tokens or max(m.stats_tokens for m in metas.values()))
    on = "trunk + each expert over its shard" + (
        "" if not recorded else ", from the experts' last training steps" if recorded == len(metas)
        else f", {recorded} of {len(metas)} experts from their last training steps")
    return _write(rd, stats, trunk, "experts", {module_name(i): m.sha256 for i, m in metas.items()}, per, on, t0)


def write_pooled(rd: RunDir, stats: RouterStats, *, t0: float, tokens: int | None = None,
                 experts: list[int] | None = None) -> dict:
    """Write G from `stats` accumulated over trunk + every expert (or `experts`), as they are now (restat.py's
    passes feed it during `sync`, so the final sync needs no second pass)."""
    trunk = read_module(rd, 0)
    ids = range(1, rd.run_info().n_experts + 1) if experts is None else experts
    experts = {module_name(i): read_module(rd, i).sha256 for i in ids}
    per = tokens or _stats_tokens(read_module(rd, next(iter(ids))))
    return _write(rd, stats, trunk, "experts", experts, per, "trunk + each expert over its shard", t0)


def _write(rd: RunDir, stats: RouterStats, trunk: ModuleMeta, source: str, experts: dict, per: int, on: str, t0: float) -> dict:
    tensors = {k: v for k, v in stats.tensors().items() if k.endswith(".second_moment")}
    return write_router_stats(rd, tensors, {
        "trunk_sha256": trunk.sha256, "source": source, "experts": experts, "tokens_per_source": per,
        "router_stats_count": stats.n, "router_stats_on": on, "seconds": round(time.perf_counter() - t0, 3),
    })


@dataclass(frozen=True)
class _Brief:
    """What the pass needs of an expert's record: a record whole holds its loss history, and a hundred of them
    held at once grew the pass's memory with the number of experts (docs/distributed.md)."""

    sha256: str
    precision: str
    stats_tokens: int

    @classmethod
    def of(cls, meta: ModuleMeta) -> "_Brief":
        return cls(str(meta.sha256), precision_of(meta), _stats_tokens(meta))


def _stats_tokens(meta: ModuleMeta) -> int:
    """Tokens of its shard an expert's own statistics measured (stats.stats_tokens)."""
    return stats_tokens(meta.train)


class _Bar:
    """A rich progress bar over the experts on stderr (elapsed, ETA), or nothing."""

    def __init__(self, total: int, enabled: bool):
        self.p = None
        if enabled:
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

            self.p = Progress(TextColumn("router statistics {task.description}"), BarColumn(), MofNCompleteColumn(),
                              TimeElapsedColumn(), TimeRemainingColumn(), console=Console(stderr=True))
            self.task = self.p.add_task("", total=total)

    def __enter__(self) -> "_Bar":
        if self.p is not None:
            self.p.start()
        return self

    def __exit__(self, *exc) -> None:
        if self.p is not None:
            self.p.stop()

    def update(self, what: str) -> None:
        if self.p is not None:
            self.p.update(self.task, description=what)

    def advance(self) -> None:
        if self.p is not None:
            self.p.advance(self.task)
