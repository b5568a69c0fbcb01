"""Router statistics gathered by training's own last steps instead of a pass over the shard afterwards.

The statistics an expert records are the per-layer means of the FFN-input vectors on its shard
(stats.py). Training's forward computes exactly those vectors, on windows of the same shard, so the
last steps that together cover `stats_tokens` tokens measure them for free, where the separate
pass was a sizeable share of a short expert job (docs/benchmarks.md). What differs is that the expert
is still moving while they are gathered (the LR is at the bottom of its decay by then) and that the
windows are training's random ones rather than the shard's first tokens;
scripts/bench_stats_tokens.py measures what that costs routed perplexity.

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

import torch

from mfgguf.train.experts.stats import RouterStats

PREFIX = "tailstats."  # checkpoint tensor names: tailstats.sum.{l} (C,) f64, tailstats.count (L,) i64


def tail_steps(stats_tokens: int, tokens_per_step: int, steps: int) -> int:
    """How many of the last steps cover `stats_tokens` tokens (all of them when training is shorter)."""
    return min(steps, max(1, math.ceil(stats_tokens / tokens_per_step)))


class TailStats:
    """Per-layer FFN-input sums over the steps from `first_step` on (0-based schedule steps)."""

    def __init__(self, n_layers: int, dim: int, first_step: int):
        self.first_step = first_step
        self.stats = RouterStats(n_layers, dim)
        self._pending: dict[int, tuple[int, torch.Tensor]] = {}  # layer -> (rows, sum) of the current micro-batch

    def active(self, step: int) -> bool:
        return step >= self.first_step

    @torch.no_grad()
    def hook(self, layer: int, n: torch.Tensor) -> None:
        """Model hook: `n` (B, T, C) after ffn_norm; kept until `commit` (a recompute overwrites it)."""
        x = n.detach().reshape(-1, n.shape[-1]).float().cpu()  # (N, C)
        self._pending[layer] = (x.shape[0], x.sum(0, dtype=torch.float64))

    def commit(self) -> None:
        """Add the micro-batch just trained on (after its backward pass) to the sums."""
        for layer, (rows, s) in self._pending.items():
            self.stats.count[layer] += rows
            self.stats.sum[layer] += s
        self._pending.clear()

    @property
    def tokens(self) -> int:
        return self.stats.n

    def state_tensors(self) -> dict[str, torch.Tensor]:
        """What a training checkpoint keeps of them."""
        out = {f"{PREFIX}sum.{l}": s.clone() for l, s in enumerate(self.stats.sum)}
        out[f"{PREFIX}count"] = torch.tensor(self.stats.count, dtype=torch.int64)
        return out

    def load_state(self, tensors: dict[str, torch.Tensor]) -> None:
        """Back from a checkpoint's `state_tensors` (none there: a checkpoint from before the last steps)."""
        if f"{PREFIX}count" not in tensors:
            return
        self.stats.count = [int(c) for c in tensors[f"{PREFIX}count"]]
        self.stats.sum = [tensors[f"{PREFIX}sum.{l}"].to(torch.float64).clone() for l in range(len(self.stats.sum))]
