"""The head's cross-entropy a chunk at a time (mfgguf/head_loss.py): the unfused loss and gradients, without the logits."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mfgguf.head_loss import head_cross_entropy


def _case(train_head: bool, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(3, 50, 32, generator=g, requires_grad=True)  # (B, T, C)
    w = (torch.randn(1000, 32, generator=g) * 0.3).requires_grad_(train_head)  # (V, C)
    y = torch.randint(0, 1000, (3, 50), generator=g)
    return x, w, y


def _unfused(x, w, y):
    return F.cross_entropy(F.linear(x, w).float().flatten(0, 1), y.flatten())


def test_f32_loss_and_gradient_are_the_unfused_ones(monkeypatch):
    monkeypatch.setattr("mfgguf.head_loss.LOGITS_CHUNK", 7_000)  # 7 positions a chunk: 22 chunks, the last short
    monkeypatch.setattr("mfgguf.head_loss.FP32_CHUNK_ROWS", 1)
    x, w, y = _case(False)
    want = _unfused(x, w, y)
    (0.25 * want).backward()  # a micro-batch's share of the step: the incoming gradient is not 1
    gx = x.grad.clone()
    x.grad = None
    got = head_cross_entropy(x, w, y)
    (0.25 * got).backward()
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(x.grad, gx, rtol=1e-5, atol=1e-7)


def test_bf16_autocast_matches_to_bf16_rounding():
    """The step's case: autocast bf16, the frozen head already bf16 (as an expert's trunk is held)."""
    x, w, y = _case(False, seed=1)
    w = w.to(torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = _unfused(x, w, y)
    want.backward()
    gx = x.grad.clone()
    x.grad = None
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = head_cross_entropy(x, w, y)
    got.backward()
    assert got.dtype == torch.float32 and abs(float(got.detach() - want.detach())) < 1e-5
    assert x.grad.dtype == torch.float32 and float((x.grad - gx).abs().max() / gx.abs().max()) < 1e-2


def test_a_head_that_trains_goes_through_autograd():
    """Its f32 weight is cast once a step by autocast's cache (test_loop.py counts the casts), which the
    chunked function could not share."""
    x, w, y = _case(True)
    kept = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: kept.append(t.numel()) or t, lambda t: t):
        head_cross_entropy(x, w, y).backward()
    assert max(kept) == 150 * 1000 and w.grad is not None


def test_backward_keeps_no_logits():
    """What autograd keeps for the backward pass: the unfused loss keeps (N, V) logits, the chunked one
    only the (N, C) gradient it made."""
    x, w, y = _case(False)
    for loss, most in ((_unfused, 150 * 1000 * 4), (head_cross_entropy, 150 * 32 * 4)):
        kept = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: kept.append(t.numel() * t.element_size()) or t,
                                                      lambda t: t):
            loss(x, w, y)
        assert max(kept) == most, (loss.__name__, kept)


def test_no_grad_is_plain_cross_entropy():
    x, w, y = _case(False)
    with torch.no_grad():
        assert torch.equal(head_cross_entropy(x, w, y), _unfused(x, w, y))


def test_an_fp32_head_takes_taller_chunks_within_a_bound():
    from mfgguf.head_loss import FP32_LOGITS_MAX, LOGITS_CHUNK, head_chunk_rows

    assert head_chunk_rows(49152, torch.bfloat16) == LOGITS_CHUNK // 49152 == 85  # bf16: as before (level or slower taller)
    assert head_chunk_rows(49152, torch.float32) == 512
    assert head_chunk_rows(151936, torch.float32) * 151936 <= FP32_LOGITS_MAX  # a large vocabulary stays bounded
    assert head_chunk_rows(10**9, torch.float32) == 1
