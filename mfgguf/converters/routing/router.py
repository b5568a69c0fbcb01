"""Router weights without retraining, computed from the statistics each expert recorded on its own shard.

Each expert file holds, per layer l, the mean mu_i (dim,) of the FFN-input vectors (after
ffn_norm) over n_i tokens of its shard. The uncentred second moment of those vectors over the
union of the shards, G (dim, dim), is recorded once per trunk (train/experts/pooled.py).
The router is llama.cpp's `ffn_gate_inp`: logits = x @ R.T with R (n_expert, dim), no bias.

Methods:
  ridge     closed-form ridge regression from x to one-hot expert labels over the union of the
            shards: W = (G + lam I)^-1 [n_1 mu_1 ... n_N mu_N] / n  (dim, N), n = sum n_i;
            lam = 1e-3 * trace(G) / dim.
  centroid  R_i = unit(mu_i - m), m the pooled mean: the direction that separates shard i.
  uniform   zeros: every expert equally likely (ties broken by llama.cpp's sort).
  random    seeded Gaussian rows, std 1/sqrt(dim): a floor for comparisons.

Scale. Top-1 only needs the argmax, but with top-k > 1 the softmax weights depend on the scale.
ridge and centroid are scaled so that, at each shard's mean vector, the shard's own expert's
logit exceeds the average of the others by MARGIN_NATS = 4 on average (e^4 times the weight of
a typical other expert): confident for in-domain tokens, still mixing near the boundaries.

Streaming: `RouterBuilder.add_mean` is fed one expert's means at a time; the state is the N small
means. The ridge router's `pooled` reader hands G over one layer at a time when the router is solved:
one layer in memory (dim x dim f32), not all of them, so memory does not grow with the experts'
sizes or the number of layers.

Example:
    >>> rb = RouterBuilder("ridge", n_layers=2, dim=64, n_experts=3, pooled=lambda l: G_of_layer(l))
    >>> # for each expert p and layer l: rb.add_mean(p, l, mu, n)
    >>> weights = rb.finish()  # list over layers of (3, 64) f32
"""

from __future__ import annotations

import ctypes
import glob
import os
from contextlib import contextmanager
from typing import Callable

import numpy as np

from mfgguf.errors import MfggufError
from mfgguf.gguf.schema import ROUTERS

MARGIN_NATS = 4.0
RIDGE_REL_LAMBDA = 1e-3


def needs_stats(method: str) -> bool:
    return method in ("ridge", "centroid")


class RouterBuilder:
    def __init__(self, method: str, *, n_layers: int, dim: int, n_experts: int, seed: int = 0,
                 pooled: Callable[[int], np.ndarray] | None = None):
        if method not in ROUTERS:
            raise MfggufError(f"unknown router {method!r}; choose one of {', '.join(ROUTERS)}")
        if method == "ridge" and pooled is None:
            raise ValueError("the ridge router needs the pooled second moment: pass pooled=")
        self.method, self.L, self.dim, self.N, self.seed = method, n_layers, dim, n_experts, seed
        self.counts = np.zeros(n_experts)  # n_i
        self.mu = np.zeros((n_layers, n_experts, dim), np.float32)  # (L, N, dim)
        self.seen_mean = np.zeros((n_layers, n_experts), bool)
        self.pooled = pooled if method == "ridge" else None  # layer l's pooled G (dim, dim), read when solved

    def add_mean(self, p: int, layer: int, mu: np.ndarray, count: int) -> None:
        """Expert in slot p: its layer-`layer` mean (dim,) over `count` tokens."""
        self.counts[p] = count
        self.mu[layer, p] = mu
        self.seen_mean[layer, p] = True

    def finish(self) -> list[np.ndarray]:
        """Router rows per layer: list of (n_experts, dim) f32."""
        L, N, D = self.L, self.N, self.dim
        if self.method == "uniform":
            return [np.zeros((N, D), np.float32) for _ in range(L)]
        if self.method == "random":
            rng = np.random.default_rng(self.seed)
            return [(rng.standard_normal((N, D)) / np.sqrt(D)).astype(np.float32) for _ in range(L)]
        if not self.seen_mean.all() or (self.counts <= 0).any():
            raise MfggufError("router statistics are incomplete (an expert recorded no tokens); retrain it or use --router uniform")
        n = self.counts.sum()
        out = []
        with _one_blas_thread():
            for l in range(L):
                out.append(self._layer(l, n))
        return out

    def _layer(self, l: int, n: float) -> np.ndarray:
        """Router rows (n_experts, dim) of layer l; n = total token count."""
        D = self.dim
        mu = self.mu[l].astype(np.float64)  # (N, D)
        if self.method == "ridge":
            G = self.pooled(l).astype(np.float64)  # (D, D) pooled second moment
            B = (self.counts[:, None] * mu).T / n  # (D, N)
            lam = RIDGE_REL_LAMBDA * np.trace(G) / D + 1e-12
            W = np.linalg.solve(G + lam * np.eye(D), B)  # (D, N)
            R = W.T  # (N, D)
        else:  # centroid
            m = (self.counts[:, None] * mu).sum(0) / n  # (D,)
            d = mu - m  # (N, D)
            R = d / np.maximum(np.linalg.norm(d, axis=1, keepdims=True), 1e-12)
        return (R * _scale(R, mu)).astype(np.float32)


def keep_rows(R: np.ndarray, old: np.ndarray, slot_of: list[int | None]) -> np.ndarray:
    """One layer's rows after experts were added or removed, leaving the kept experts' routing alone.

    R (N, D): the rows recomputed for the new set of experts; old (N_old, D): the rows the file had;
    slot_of[q]: the old slot of new slot q, None for an added expert. Kept experts keep their old rows
    exactly, so tokens are ranked among them as before; an added expert's row is R's times the
    factor that best maps R's kept rows onto their old ones (least squares), so its logits are on
    the old rows' scale.

    Example:
        >>> keep_rows(np.eye(3, 4) * 2, np.eye(2, 4), [0, 1, None])[2]  # the added row, at the old scale
        array([0., 0., 1., 0.], dtype=float32)
    """
    kept = [q for q, o in enumerate(slot_of) if o is not None]
    out = R.astype(np.float64)
    if kept:
        a, b = out[kept], old[[slot_of[q] for q in kept]].astype(np.float64)  # (K, D) each
        den = float((a * a).sum())
        alpha = float((a * b).sum()) / den if den > 0 else 1.0
        out = out * (alpha if alpha > 0 else 1.0)
        out[kept] = b
    return out.astype(np.float32)


def _scale(R: np.ndarray, mu: np.ndarray) -> float:
    """Factor that makes the average own-vs-others logit margin at the shard means MARGIN_NATS."""
    N = len(R)
    if N < 2:
        return 1.0
    S = mu @ R.T  # (N, N): logits of every expert at every shard mean
    margin = np.mean(np.diag(S) - (S.sum(1) - np.diag(S)) / (N - 1))
    return MARGIN_NATS / margin if margin > 1e-12 else 1.0


@contextmanager
def _one_blas_thread():
    """Run numpy's OpenBLAS on one thread inside the block.

    These solves are small (dim x dim, dim ~ 1024): OpenBLAS's thread hand-offs cost more than they
    save, badly so on small shared machines (docs/assembly.md). Nothing changes where no OpenBLAS is found.
    """
    lib = _openblas()
    if lib is None:
        yield
        return
    get, set_ = lib
    old = get()
    set_(1)
    try:
        yield
    finally:
        set_(old)


_BLAS: list | None = None


def _openblas():
    """(get_num_threads, set_num_threads) of the OpenBLAS that numpy loaded, or None."""
    global _BLAS
    if _BLAS is None:
        _BLAS = [None]
        paths = []
        try:  # the copy numpy actually loaded (its wheels bundle one under numpy.libs/)
            with open("/proc/self/maps") as f:
                paths = sorted({ln.split(None, 5)[-1].strip() for ln in f if "openblas" in ln.lower()})
        except OSError:
            paths = glob.glob(os.path.join(os.path.dirname(os.path.dirname(np.__file__)), "numpy.libs", "*openblas*"))
        for path in paths:
            try:
                lib = ctypes.CDLL(path)
            except OSError:
                continue
            for get, set_ in (("scipy_openblas_get_num_threads64_", "scipy_openblas_set_num_threads64_"),
                              ("openblas_get_num_threads64_", "openblas_set_num_threads64_"),
                              ("openblas_get_num_threads", "openblas_set_num_threads")):
                if hasattr(lib, get) and hasattr(lib, set_):
                    g, s = getattr(lib, get), getattr(lib, set_)
                    g.restype, g.argtypes, s.restype, s.argtypes = ctypes.c_int, [], None, [ctypes.c_int]
                    _BLAS[0] = (g, s)
                    break
            if _BLAS[0] is not None:
                break
    return _BLAS[0]
