"""Router from recorded statistics: ridge/centroid separate shards, ridge is the closed form, calibrated scale."""

from __future__ import annotations

import numpy as np
import pytest

from mfgguf.converters.routing.router import MARGIN_NATS, RouterBuilder
from mfgguf.errors import MfggufError


def _shards(N=4, D=16, n=2000, seed=0):
    """Real samples from N Gaussian clusters -> (counts, means, second moments)."""
    rng = np.random.default_rng(seed)
    centres = rng.standard_normal((N, D)) * 2
    xs = [centres[i] + rng.standard_normal((n + 100 * i, D)) for i in range(N)]
    return xs, [len(x) for x in xs], [x.mean(0) for x in xs], [x.T @ x / len(x) for x in xs]


def _build(method, counts, mus, Ms):
    """The router from each expert's mean and the pooled second moment G = sum n_i M_i / n, a layer at a time."""
    N, D = len(counts), len(mus[0])
    G = (sum(n * M for n, M in zip(counts, Ms)) / sum(counts)).astype(np.float32)
    rb = RouterBuilder(method, n_layers=1, dim=D, n_experts=N, pooled=lambda l: G)
    for p in range(N):  # one expert's statistics at a time
        rb.add_mean(p, 0, mus[p].astype(np.float32), counts[p])
    return rb.finish()[0]


@pytest.mark.parametrize("method", ["ridge", "centroid"])
def test_routes_samples_to_their_shard(method):
    xs, counts, mus, Ms = _shards()
    R = _build(method, counts, mus, Ms)
    assert R.shape == (4, 16) and R.dtype == np.float32
    acc = np.mean(np.concatenate([np.argmax(x @ R.T, 1) == i for i, x in enumerate(xs)]))
    assert acc > 0.9, acc


def test_ridge_matches_closed_form():
    xs, counts, mus, Ms = _shards()
    R = _build("ridge", counts, mus, Ms)
    X = np.concatenate(xs)
    Y = np.concatenate([np.eye(4)[[i] * len(x)] for i, x in enumerate(xs)])
    G = X.T @ X / len(X)
    W = np.linalg.solve(G + 1e-3 * np.trace(G) / 16 * np.eye(16), X.T @ Y / len(X))  # (D, N)
    cos = (W.T * R).sum() / np.linalg.norm(W) / np.linalg.norm(R)
    assert cos > 0.9999  # same direction; R only adds the calibration scale


def test_margin_calibration():
    xs, counts, mus, Ms = _shards()
    R = _build("ridge", counts, mus, Ms)
    S = np.stack(mus) @ R.T
    margin = np.mean(np.diag(S) - (S.sum(1) - np.diag(S)) / 3)
    assert margin == pytest.approx(MARGIN_NATS, rel=1e-4)


def test_uniform_random_and_missing_stats():
    rb = RouterBuilder("uniform", n_layers=2, dim=8, n_experts=3)
    assert all((w == 0).all() and w.shape == (3, 8) for w in rb.finish())
    a = RouterBuilder("random", n_layers=1, dim=8, n_experts=3, seed=5).finish()[0]
    b = RouterBuilder("random", n_layers=1, dim=8, n_experts=3, seed=5).finish()[0]
    assert np.array_equal(a, b) and a.std() > 0
    rb = RouterBuilder("ridge", n_layers=1, dim=8, n_experts=2, pooled=lambda l: np.eye(8, dtype=np.float32))
    rb.add_mean(0, 0, np.ones(8, np.float32), 10)
    with pytest.raises(MfggufError, match="incomplete"):
        rb.finish()
    with pytest.raises(MfggufError, match="unknown router"):
        RouterBuilder("learned", n_layers=1, dim=8, n_experts=2)
    with pytest.raises(ValueError, match="pooled second moment"):
        RouterBuilder("ridge", n_layers=1, dim=8, n_experts=2)
