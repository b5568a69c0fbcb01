"""Router statistics: per layer, count, sum and second moment of the FFN-input vectors.

The assembler computes the router in closed form from these (e.g. ridge regression needs the pooled
second moment and each expert's mean), so experts never need each other. Accumulation is in
float64; each batch's x^T x is one f32 matmul over at most a few thousand tokens (a float64
matmul over dim x dim for every token would dominate a 1B model's statistics pass).

Example:
    >>> stats = RouterStats(n_layers=4, dim=256)
    >>> model(idx, route="single", hook=stats.hook)
    >>> tensors = stats.tensors()  # {"router_stats.blk.0.mean": (256,), ...}
"""

from __future__ import annotations

import torch

from ..run import STATS_PREFIX


class RouterStats:
    def __init__(self, n_layers: int, dim: int):
        self.count = [0] * n_layers
        self.sum = [torch.zeros(dim, dtype=torch.float64) for _ in range(n_layers)]  # (C,)
        self.sq = [torch.zeros(dim, dim, dtype=torch.float64) for _ in range(n_layers)]  # (C, C)

    @torch.no_grad()
    def hook(self, layer: int, n: torch.Tensor) -> None:
        """Model hook: `n` (B, T, C) is the vector after ffn_norm that every FFN and the router see."""
        x = n.detach().reshape(-1, n.shape[-1]).float().cpu()  # (N, C)
        self.count[layer] += x.shape[0]
        self.sum[layer] += x.sum(0, dtype=torch.float64)
        self.sq[layer] += (x.T @ x).double()  # (C, C)

    @property
    def n(self) -> int:
        return self.count[0] if self.count else 0

    def tensors(self) -> dict[str, torch.Tensor]:
        """Means as f32: `router_stats.blk.{l}.mean` (C,) and `.second_moment` (C, C)."""
        out = {}
        for l, (c, s, q) in enumerate(zip(self.count, self.sum, self.sq)):
            c = max(c, 1)
            out[f"{STATS_PREFIX}blk.{l}.mean"] = (s / c).float()
            out[f"{STATS_PREFIX}blk.{l}.second_moment"] = (q / c).float()
        return out
