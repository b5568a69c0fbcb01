"""Router statistics gathered by training's own last steps instead of a pass over the shard afterwards.

The statistics an expert records are the per-layer means of the FFN-input vectors on its shard
(stats.py). Training's forward computes exactly those vectors, on windows of the same shard, so the
last steps that together cover `stats_tokens` tokens measure them for free, where the separate
pass was a sizeable share of a short expert job (docs/benchmarks.md). What differs is that the expert
is still moving while they are gathered (the LR is at the bottom of its decay by then) and that the
windows are training's random ones rather than the shard's first tokens;
scripts/bench/bench_stats_tokens.py measures what that costs routed perplexity.

With `moments` they also gather each layer's second moment (x^T x): the router's pooled G is their
count-weighted mean over the experts, so `router-stats` (and `assemble`, which runs it) pools them instead
of a forward pass of trunk + each expert over its shard (pooled.py), and the final `sync` of experts with
shared copies instead of one of merged trunk + each expert (train/rounds/adopt.py). The module keeps its
means only; the moments go beside it (`write_moments`), each layer's upper triangle in f32 (the matrix is
symmetric): half the full matrix's bytes (what they cost and spare: docs/studies/routing.md).

Exactness under recompute: a checkpointed block runs its forward twice (once, then again in the
backward pass), so the hook keeps each layer's figures of the current micro-batch aside, the
recomputation overwriting them with the same values, and `commit` adds them once after the
micro-batch's backward. The sums live in the training checkpoint, so a killed run resumes to the
same statistics bit for bit.

Example:
    >>> tail = TailStats(n_layers=30, dim=576, first_step=12)
    >>> tail.active(12)  # the steps from 12 on pass `tail.hook` to the forward, then `tail.commit()`
    True
    >>> tail.stats.tensors()  # {"router_stats.blk.0.mean": (576,), ...}
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from mfgguf.run import STATS_PREFIX, RunDir, atomic_path, module_name
from mfgguf.train.experts.stats import RouterStats

PREFIX = "tailstats."  # checkpoint tensor names: tailstats.sum.{l} (C,) f64, tailstats.count (L,) i64, tailstats.sq.{l} (C, C)


def tail_steps(stats_tokens: int, tokens_per_step: int, steps: int) -> int:
    """How many of the last steps cover `stats_tokens` tokens (all of them when training is shorter)."""
    return min(steps, max(1, math.ceil(stats_tokens / tokens_per_step)))


class TailStats:
    """Per-layer FFN-input sums over the steps from `first_step` on (0-based schedule steps)."""

    def __init__(self, n_layers: int, dim: int, first_step: int, moments: bool = False):
        self.first_step = first_step
        self.stats = RouterStats(n_layers, dim, second_moment=moments)
        # layer -> (rows, sum) of the current micro-batch, and its FFN inputs (N, C) where moments are gathered
        self._pending: dict[int, tuple[int, torch.Tensor, torch.Tensor | None]] = {}

    def active(self, step: int) -> bool:
        return step >= self.first_step

    @torch.no_grad()
    def hook(self, layer: int, n: torch.Tensor) -> None:
        """Model hook: `n` (B, T, C) after ffn_norm; kept until `commit` (a recompute overwrites it). The inputs
        themselves are kept only for the moments, whose x^T x `commit` then computes once, not per forward."""
        x = n.detach().reshape(-1, n.shape[-1]).float().cpu()  # (N, C)
        self._pending[layer] = (x.shape[0], x.sum(0, dtype=torch.float64), x if self.stats.sq is not None else None)

    @torch.no_grad()
    def commit(self) -> None:
        """Add the micro-batch just trained on (after its backward pass) to the sums: once, whatever recomputed it."""
        for layer, (rows, s, x) in self._pending.items():
            self.stats.count[layer] += rows
            self.stats.sum[layer] += s
            if x is not None:
                self.stats.sq[layer] += (x.T @ x).double()  # (C, C)
        self._pending.clear()

    @property
    def tokens(self) -> int:
        return self.stats.n

    def state_tensors(self) -> dict[str, torch.Tensor]:
        """What a training checkpoint keeps of them."""
        out = {f"{PREFIX}sum.{l}": s.clone() for l, s in enumerate(self.stats.sum)}
        out[f"{PREFIX}count"] = torch.tensor(self.stats.count, dtype=torch.int64)
        for l, q in enumerate(self.stats.sq or ()):
            out[f"{PREFIX}sq.{l}"] = q.clone()
        return out

    def load_state(self, tensors: dict[str, torch.Tensor]) -> None:
        """Back from a checkpoint's `state_tensors` (none there: a checkpoint from before the last steps)."""
        if f"{PREFIX}count" not in tensors:
            return
        self.stats.count = [int(c) for c in tensors[f"{PREFIX}count"]]
        self.stats.sum = [tensors[f"{PREFIX}sum.{l}"].to(torch.float64).clone() for l in range(len(self.stats.sum))]
        if self.stats.sq is not None:
            self.stats.sq = [tensors[f"{PREFIX}sq.{l}"].to(torch.float64).clone() for l in range(len(self.stats.sq))]


def moments_path(rd: RunDir, i: int) -> Path:
    """Where expert i's second moments wait: for `router-stats` and assembly, or for the final sync."""
    return rd.rounds / "moments" / f"{module_name(i)}.safetensors"


def upper_name(layer: int) -> str:
    """A moments file's tensor: the layer's second moment, upper triangle row by row, (dim * (dim + 1) / 2,) f32."""
    return f"{STATS_PREFIX}blk.{layer}.second_moment.upper"


def write_moments(rd: RunDir, i: int, stats: RouterStats, module_sha256: str) -> Path:
    """Expert i's per-layer second moments (f32, upper triangles), naming the module they belong to."""
    path = moments_path(rd, i)
    path.parent.mkdir(parents=True, exist_ok=True)
    moments = [t for k, t in stats.tensors().items() if k.endswith(".second_moment")]
    rows, cols = torch.triu_indices(*moments[0].shape) if moments else (None, None)
    tensors = {upper_name(l): m[rows, cols].contiguous() for l, m in enumerate(moments)}  # (C(C+1)/2,)
    with atomic_path(path) as tmp:
        save_file(tensors, str(tmp), metadata={"module_sha256": module_sha256, "count": str(stats.n)})
    return path


def read_moments(rd: RunDir, i: int, module_sha256: str, n_layers: int, dim: int) -> RouterStats | None:
    """Expert i's moments as RouterStats sums (count x moment), or None where absent, of another module, of
    another shape (a file this version did not write), or damaged (cut short, unreadable: one line on stderr says
    so); the caller then measures that expert by a forward pass, as where none was recorded."""
    path = moments_path(rd, i)
    if not path.is_file():
        return None
    try:
        return _read_moments(path, module_sha256, n_layers, dim)
    except (SafetensorError, OSError, ValueError, KeyError, RuntimeError) as e:
        print(f"mfgguf: {path} is damaged ({str(e).splitlines()[0] if str(e) else type(e).__name__}): expert {i} is"
              " measured by a forward pass instead; `mfgguf train-expert` writes it again", file=sys.stderr)
        return None


def _read_moments(path: Path, module_sha256: str, n_layers: int, dim: int) -> RouterStats | None:
    rows, cols = torch.triu_indices(dim, dim)
    with safe_open(str(path), "pt") as f:
        header = f.metadata() or {}  # the safetensors file's own: the module it describes, the tokens it covers
        if header.get("module_sha256") != module_sha256 or set(f.keys()) != {upper_name(l) for l in range(n_layers)}:
            return None
        out = RouterStats(n_layers, dim, second_moment=True)
        n = int(header["count"])
        out.count = [n] * n_layers
        for l in range(n_layers):
            upper = f.get_tensor(upper_name(l)).double()  # (C(C+1)/2,)
            if upper.shape != rows.shape:
                return None
            m = torch.zeros(dim, dim, dtype=torch.float64)
            m[rows, cols] = upper
            m[cols, rows] = upper  # the lower triangle mirrors it
            out.sq[l] = m * n
    return out
