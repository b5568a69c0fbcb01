"""The batch sampler: shuffled epochs over a shard's windows, every target token once a pass, no state to carry."""

from __future__ import annotations

import math
from collections import Counter

import numpy as np
import pytest
import torch

from mfgguf.errors import MfggufError
from mfgguf.run import RunDir
from mfgguf.train.engine.driver import epoch_grid, epochs_of, get_batch, grid_sizes
from mfgguf.train.engine.loop import load_tokens

CTX, B = 16, 4


def _starts(n: int, windows: int, seed: int = 3, stream: int = 1) -> np.ndarray:
    """The start of each of the first `windows` windows get_batch returns on tokens 0..n-1 (token = position)."""
    toks = np.arange(n, dtype=np.uint32)
    xs = [get_batch(toks, seed, stream, s, B, CTX)[0] for s in range(math.ceil(windows / B))]
    x = torch.cat(xs)[:windows]  # (windows, CTX)
    assert torch.equal(x, x[:, :1] + torch.arange(CTX))  # contiguous windows of the data
    return x[:, 0].numpy()


def test_one_epoch_sees_every_window_exactly_once():
    n = 10_007  # (n - 1) // CTX = 625 windows, not a multiple of the batch: an epoch ends inside a step
    w0, _ = grid_sizes(n, CTX)
    starts = _starts(n, w0)
    assert sorted(starts) == list(range(0, w0 * CTX, CTX))  # the grid from token 0, each window once
    assert not np.array_equal(starts, np.sort(starts))  # in a shuffled order
    # each target token once: all but the last (n - 1) % CTX tokens, which no whole window reaches
    targets = (starts[:, None] + 1 + np.arange(CTX)).ravel()
    assert sorted(targets) == list(range(1, w0 * CTX + 1)) and n - 1 - w0 * CTX < CTX


def test_two_epochs_see_each_token_twice():
    n = 10_007
    w0, w1 = grid_sizes(n, CTX)
    starts = _starts(n, w0 + w1)
    later = starts[w0:]
    offset = later.min()
    assert sorted(later - offset) == list(range(0, w1 * CTX, CTX))  # one grid, each of its windows once
    assert offset == epoch_grid(n, CTX, 3, 1, 1)[0] and 0 <= offset and later.max() + CTX + 1 <= n
    seen = Counter((starts[:, None] + 1 + np.arange(CTX)).ravel().tolist())
    assert max(seen.values()) == 2
    missed = [t for t in range(1, n) if seen[t] < 2]
    assert len(missed) < 2 * CTX  # under two windows' worth, at the shifted grid's edges
    assert all(t <= offset or t > offset + w1 * CTX or t > w0 * CTX for t in missed)


def test_later_epochs_shift_the_grid_and_reorder():
    n = 10_007
    grids = [epoch_grid(n, CTX, 0, 1, e) for e in range(1, 9)]
    assert len({off % CTX for off, _ in grids}) > 1  # not always the same window boundaries
    assert not np.array_equal(grids[0][1], grids[1][1])


def test_batch_is_a_pure_function_of_seed_stream_step():
    toks = np.arange(5_000, dtype=np.uint16)  # no two windows alike
    far = 3 * 5_000 // (B * CTX)  # a step in the fourth epoch
    x1, y1 = get_batch(toks, 7, 1, far, B, CTX)
    epoch_grid.cache_clear()  # no state carried: a fresh process draws the same batch
    x2, y2 = get_batch(toks, 7, 1, far, B, CTX)
    assert torch.equal(x1, x2) and torch.equal(y1, y2) and torch.equal(x1[:, 1:], y1[:, :-1])
    assert not torch.equal(x1, get_batch(toks, 7, 2, far, B, CTX)[0])  # another stream differs
    assert not torch.equal(x1, get_batch(toks, 8, 1, far, B, CTX)[0])  # another seed differs
    assert not np.array_equal(_starts(10_007, 64, stream=1), _starts(10_007, 64, stream=2))


def test_a_batch_larger_than_the_shard_wraps_into_later_epochs():
    n = 3 * CTX + 5  # three windows in epoch 0, two in each later one
    assert grid_sizes(n, CTX) == (3, 2)
    x, y = get_batch(np.arange(n, dtype=np.uint16), 0, 0, 0, 8, CTX)  # epochs 0, 1, 2 and half of 3
    assert x.shape == y.shape == (8, CTX) and int(y.max()) < n
    assert sorted(x[:3, 0].tolist()) == [0, CTX, 2 * CTX]


def test_a_shard_of_one_window_trains_and_one_token_less_is_refused():
    """check_shards (fan-out) lets through a shard of ctx_len + 1 tokens; the sampler must train it, not fail later."""
    x, y = get_batch(np.arange(CTX + 1, dtype=np.uint16), 0, 0, 5, 2, CTX)  # every epoch is the one window
    assert x[:, 0].tolist() == [0, 0] and int(y[0, -1]) == CTX
    with pytest.raises(MfggufError, match=f"fewer than one context of {CTX + 1}"):
        get_batch(np.arange(CTX, dtype=np.uint16), 0, 0, 0, 2, CTX)


def test_real_shard_one_epoch_predicts_each_token_once(prepared_run):
    shard = load_tokens(RunDir(prepared_run).shard(1), "shard")
    n, ctx, b = len(shard), 32, 8
    w0, _ = grid_sizes(n, ctx)
    ys = torch.cat([get_batch(shard, 0, 1, s, b, ctx)[1] for s in range(math.ceil(w0 / b))])[:w0]  # (w0, ctx)
    assert Counter(ys.ravel().tolist()) == Counter(np.asarray(shard[1: w0 * ctx + 1]).tolist())
    assert epochs_of(w0 * ctx, n) == round(w0 * ctx / n, 3) and 0.99 < epochs_of(w0 * ctx, n) <= 1
