"""Router statistics: per layer, count, sum and (optionally) second moment of the FFN-input vectors.

The assembler computes the router in closed form from these (ridge regression needs the pooled
second moment and each expert's mean), so experts never need each other. Experts record means
only; the second moment is pooled once per trunk (pooled.py). Accumulation is in
float64; each batch's x^T x is one f32 matmul over at most a few thousand tokens (a float64
matmul over dim x dim for every token would dominate a 1B model's statistics pass).

Example:
    >>> stats = RouterStats(n_layers=4, dim=256)
    >>> model(idx, route="single", hook=stats.hook)
    >>> tensors = stats.tensors()  # {"router_stats.blk.0.mean": (256,), ...}
    >>> RouterStats(4, 256, second_moment=True).tensors()  # also "router_stats.blk.0.second_moment": (256, 256)
"""

from __future__ import annotations

import torch

from mfgguf.run import STATS_PREFIX


class RouterStats:
    def __init__(self, n_layers: int, dim: int, second_moment: bool = False):
        self.count = [0] * n_layers
        self.sum = [torch.zeros(dim, dtype=torch.float64) for _ in range(n_layers)]  # (C,)
        self.sq = [torch.zeros(dim, dim, dtype=torch.float64) for _ in range(n_layers)] if second_moment else None  # (C, C)

    @torch.no_grad()
    def hook(self, layer: int, n: torch.Tensor) -> None:
        """Model hook: `n` (B, T, C) is the vector after ffn_norm that every FFN and the router see."""
        x = n.detach().reshape(-1, n.shape[-1]).float().cpu()  # (N, C)
        self.count[layer] += x.shape[0]
        self.sum[layer] += x.sum(0, dtype=torch.float64)
        if self.sq is not None:
            self.sq[layer] += (x.T @ x).double()  # (C, C)

    def add(self, other: "RouterStats") -> None:
        """Pool another pass's statistics into these (counts add, so do sums and second moments)."""
        for l in range(len(self.count)):
            self.count[l] += other.count[l]
            self.sum[l] += other.sum[l]
            if self.sq is not None:
                self.sq[l] += other.sq[l]

    @property
    def n(self) -> int:
        return self.count[0] if self.count else 0

    def tensors(self) -> dict[str, torch.Tensor]:
        """Means as f32: `router_stats.blk.{l}.mean` (C,), and `.second_moment` (C, C) if recorded."""
        out = {}
        for l, (c, s) in enumerate(zip(self.count, self.sum)):
            c = max(c, 1)
            out[f"{STATS_PREFIX}blk.{l}.mean"] = (s / c).float()
            if self.sq is not None:
                out[f"{STATS_PREFIX}blk.{l}.second_moment"] = (self.sq[l] / c).float()
        return out


def stats_tokens(train: dict) -> int:
    """Tokens of its shard an expert's own statistics are measured over (train/experts/expert.py), from its TrainConfig
    (as a dict): stats_tokens, or 4 x eval_tokens where that is 0 or absent (modules of earlier versions)."""
    return int(train.get("stats_tokens") or 4 * int(train.get("eval_tokens", 65_536)))
