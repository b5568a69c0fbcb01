"""The output head's mean cross-entropy, a chunk of positions at a time, its gradient made in the forward pass.

`F.cross_entropy(head(x).float(), y)` keeps the (N, vocabulary) logits in the compute dtype, their f32 copy
and their log-softmax for the backward pass, and makes a gradient as large: at Qwen2.5's 151,936-token
vocabulary a third of an expert step's activations (docs/studies/speed.md has the figures). The head's
gradient is known as soon as the loss is: d(mean CE)/d logits = (softmax - onehot) / N. So each chunk of
positions computes its logits, its loss and at once the gradient it sends to x, and lets its logits go;
the backward pass only scales what was kept by the incoming gradient. No logits are recomputed (as a
checkpointed head would, once more per step), and peak memory holds one chunk's logits whatever N is
(the fused linear cross-entropy of Liger-Kernel, for the CPU).

Only a frozen head takes this path (an expert's step, where the head is the trunk's, held in bf16): a head
that trains goes through autograd as before, where autocast casts its f32 weight once a step (its cast
cache), which a custom function cannot share.

The arithmetic is the unfused path's: the head's matmuls in the autocast dtype (bf16 where the step runs
bf16), the softmax and the loss in f32, the gradient cast to the logits' dtype before its matmuls, as
autograd casts it; the one difference is that the incoming gradient (1, or 1/micro-batches) multiplies
after those matmuls instead of before.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100  # a target the loss leaves out (a loss mask's context token: data/masks.py); F.cross_entropy's default
LOGITS_CHUNK = 1 << 22  # logits elements per chunk (4 bytes each in f32): one chunk stays in cache
FP32_CHUNK_ROWS = 512  # positions per chunk at least where the head runs fp32 (no native bf16): LOGITS_CHUNK is 85
#                        positions at SmolLM2's vocabulary, too short for the fp32 kernels to near the peak; taller
#                        chunks did not pay in bf16 (docs/studies/speed.md, the AVX2 section)
FP32_LOGITS_MAX = 1 << 25  # ... but no more logits than this a chunk (a bound whatever the vocabulary); the micro-batch
#                            plan (train/whole/trunk.py) still counts a LOGITS_CHUNK, so every CPU plans alike


def head_chunk_rows(vocab: int, dtype: torch.dtype) -> int:
    """Positions the training head computes the logits of at once, its matmuls in `dtype`."""
    rows = LOGITS_CHUNK // vocab
    if dtype == torch.float32:
        rows = max(rows, min(FP32_CHUNK_ROWS, FP32_LOGITS_MAX // vocab))
    return max(1, rows)


def matmul_dtype(x: torch.Tensor, w: torch.Tensor) -> torch.dtype:
    """The dtype the head's matmuls run in: autocast's where it is on (as autograd would cast), else the head's."""
    dev = x.device.type
    return torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else w.dtype


class ChunkedHeadLoss(torch.autograd.Function):
    """mean_i CE(x_i @ w.T, y_i), chunk by chunk, for a frozen w; x -> loss, with x's gradient made in forward."""

    @staticmethod
    def forward(ctx, x, w, y, chunk: int):  # x: (N, C), w: (V, C), y: (N,) int64 -> () f32
        N = y.numel()
        n = (y != IGNORE_INDEX).sum().clamp_min(1)  # the counted targets (no host sync: a compiled step stays whole)
        dt = matmul_dtype(x, w)
        wc = w.to(dt)  # (V, C): cast once for every chunk (a bf16 head is not copied)
        gx = torch.empty_like(x)  # (N, C)
        total = torch.zeros((), dtype=torch.float32, device=x.device)
        for s in range(0, N, chunk):
            xs, ys = x[s : s + chunk].to(dt), y[s : s + chunk]  # (n, C), (n,)
            keep = ys != IGNORE_INDEX  # (n,): a target at IGNORE_INDEX is left out of the loss and sends no gradient
            ys = ys.clamp_min(0)
            logits = F.linear(xs, wc).float()  # (n, V)
            lse = torch.logsumexp(logits, -1)  # (n,)
            total += torch.where(keep, lse - logits.gather(1, ys[:, None])[:, 0], 0.0).sum()
            g = logits.sub_(lse[:, None]).exp_()  # (n, V) softmax, in place of the logits
            g[torch.arange(len(ys), device=g.device), ys] -= 1.0
            g = g.mul_(keep[:, None]).div_(n).to(dt)  # d(mean CE)/d logits, in the dtype autograd hands the matmuls
            gx[s : s + chunk] = g @ wc  # (n, C)
        ctx.save_for_backward(gx)
        return total / n

    @staticmethod
    def backward(ctx, grad):  # grad: () -> x's gradient, scaled
        (gx,) = ctx.saved_tensors
        return gx * grad.to(gx.dtype), None, None, None


def head_cross_entropy(x, weight, y):  # x: (..., C), weight: (V, C), y: (...) -> () mean cross-entropy
    """The mean cross-entropy of the head `weight` over every position of x, LOGITS_CHUNK logits at a time.

    Without a gradient to make (no_grad, or nothing upstream trains), or with a head that trains, it is
    plain cross-entropy over the whole logits. Targets at IGNORE_INDEX (a loss mask's context tokens) are
    left out: the mean is over the counted ones, and a batch with none counted has loss 0 and no gradient."""
    if not torch.is_grad_enabled() or not x.requires_grad or weight.requires_grad:
        y = y.reshape(-1)
        ce = F.cross_entropy(F.linear(x, weight).float().reshape(-1, weight.size(0)), y, ignore_index=IGNORE_INDEX)
        return torch.where((y != IGNORE_INDEX).any(), ce, 0.0)  # nothing counted: 0, not the mean's 0/0
    x2 = x.reshape(-1, x.size(-1))  # (N, C)
    chunk = head_chunk_rows(weight.size(0), matmul_dtype(x, weight))
    return ChunkedHeadLoss.apply(x2, weight, y.reshape(-1), chunk)
