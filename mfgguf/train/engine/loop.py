"""In-memory training of the trunk and the experts: device and precision, the forward with its
chunked loss, held-out evaluation, AdamW, and the in-memory step with its checkpoints (the driver
around it, shared with layer-streamed training, is driver.py).

Exact resume is a design property, not a feature bolted on: the batch at step s is drawn from a
generator seeded by (seed, stream, s), so it does not depend on history; the only state is the
trainable parameters, AdamW's moments and the loss history, all of which a checkpoint holds.

Memory: with `recompute=True` each block's activations are recomputed in the backward pass
(only block inputs are kept) and the output head + cross-entropy run in chunks, so a frozen
1B-parameter trunk trains an expert in little more memory than its bf16 weights.
"""

from __future__ import annotations

import ctypes
import os
import sys
import time
from contextlib import nullcontext
from dataclasses import asdict, replace
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint as _ckpt

from mfgguf.config import ModelConfig, TrainConfig
from mfgguf.data.masks import counted_share, load_mask, target_mask
from mfgguf.errors import MfggufError
from mfgguf.head_loss import LOGITS_CHUNK, head_cross_entropy
from mfgguf.machine import startup_s
from mfgguf.model import Transformer, rope_for
from mfgguf.run import RunInfo
from mfgguf.train.engine import checkpoint as ckpt_io
from mfgguf.train.engine.driver import LoopResult, schedule_steps, train_steps
from mfgguf.train.engine.records import Checkpoints, Drive, StepSetup
from mfgguf.train.experts.tailstats import PREFIX as TAIL_PREFIX
from mfgguf.train.experts.tailstats import TailStats

EVAL_ROWS = 4096  # token positions per forward when scoring: one window at a time left SmolLM2's
#                   matmuls 256 rows tall, too short to keep the cores busy (docs/benchmarks.md)
EVAL_HEAD_CHUNKS = 2  # scoring's head chunk, in LOGITS_CHUNKs (32 MB in f32): a chunk that stays in cache is
#                      scored faster than a larger one (docs/benchmarks.md, scoring's head)
_BF16_CPU: bool | None = None  # probed once


# ---- device and precision ------------------------------------------------------------------------


def resolve_device(device: str) -> torch.device:
    """'cpu' or 'cuda' (clear error when CUDA is not available)."""
    if device == "cpu":
        # every core, unless the caller chose (train-experts gives each job its share through OMP_NUM_THREADS)
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS") or 0) or os.cpu_count() or 1)
        return torch.device("cpu")
    if device == "cuda":
        if not torch.cuda.is_available():
            raise MfggufError("--device cuda was asked but this torch sees no CUDA GPU; use --device cpu")
        return torch.device("cuda")
    raise MfggufError(f"unknown device {device!r}; choose cpu or cuda")


def _bf16_supported(dev: torch.device) -> bool:
    global _BF16_CPU
    if dev.type == "cuda":
        return torch.cuda.is_bf16_supported()
    if _BF16_CPU is None:
        try:  # oneDNN reports native bf16 (avx512_bf16 / amx); without it bf16 is emulated and slow
            ok = bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
            with torch.autocast("cpu", dtype=torch.bfloat16):
                ok = ok and (torch.ones(4, 4) @ torch.ones(4, 4)).dtype == torch.bfloat16
        except Exception:
            ok = False
        _BF16_CPU = ok
    return _BF16_CPU


def resolve_precision(precision: str, dev: torch.device) -> str:
    """'auto' -> 'bf16' where the device has native bf16, else 'fp32'."""
    if precision not in ("auto", "bf16", "fp32"):
        raise MfggufError(f"unknown precision {precision!r}; choose auto, bf16 or fp32")
    if precision == "auto":
        return "bf16" if _bf16_supported(dev) else "fp32"
    if precision == "bf16" and dev.type == "cuda" and not _bf16_supported(dev):
        raise MfggufError("this GPU has no bf16; pass --precision fp32")
    return precision


def autocast(precision: str, dev: torch.device):
    """bf16 autocast for precision 'bf16', else a no-op context."""
    return torch.autocast(dev.type, dtype=torch.bfloat16) if precision == "bf16" else nullcontext()


def autocast_off(precision: str, dev: torch.device):
    """Autocast switched off inside an autocast region (a backward pass), which keeps the region's
    cache of bf16 weight casts: torch drops the cache only on leaving the outermost region."""
    return torch.autocast(dev.type, enabled=False) if precision == "bf16" else nullcontext()


def limit_heap_retention(threshold: int = 1 << 20) -> None:
    """Make glibc return freed activation buffers to the OS.

    glibc raises its mmap threshold each time a large block is freed, after which activation-sized
    buffers come from the heap and stay resident once freed (docs/benchmarks.md: a `1b` expert's RSS). A
    fixed threshold keeps every buffer over 1 MB in its own mapping. No-op off glibc.
    """
    try:
        ctypes.CDLL("libc.so.6").mallopt(-3, threshold)  # -3 = M_MMAP_THRESHOLD
    except (OSError, AttributeError):
        pass


# ---- data -----------------------------------------------------------------------------------------


def load_tokens(path: Path, what: str) -> np.ndarray:
    """A memory-mapped 1-D token array (never unpickled)."""
    if not Path(path).is_file():
        raise MfggufError(f"{what} is missing: {path}; re-create the run with `mfgguf prepare`")
    try:
        a = np.load(path, mmap_mode="r", allow_pickle=False)
    except (OSError, ValueError) as e:
        raise MfggufError(f"{what} is unreadable: {path} ({e}); re-create the run with `mfgguf prepare`") from None
    if a.ndim != 1 or a.dtype.kind not in "ui":
        raise MfggufError(f"{what} must be a 1-D integer array, got {a.dtype} {a.shape}: {path}")
    return a


# ---- forward with optional recompute and chunked loss ---------------------------------------------


def head_loss(model: Transformer, x, y, reduction: str = "sum"):  # x: (N, C), y: (N,) -> () or (N,) with "none"
    """The output norm, head and cross-entropy of N positions (call it on scoring_positions(model) at a time)."""
    logits = model.output(model.output_norm(x))  # (N, V)
    return F.cross_entropy(logits.float(), y, reduction=reduction)


def score_head(model: Transformer, x, y, weight):  # x: (N, C), y: (N,), weight: (V, C) -> () summed cross-entropy
    """head_loss's sum without the (N, V) log-probabilities: log-sum-exp less the target's logit, in f32.

    Scoring has no backward, so F.cross_entropy's written-out log-softmax is pure memory traffic; `weight`
    is the head already in the compute precision, cast once per scoring pass instead of once per chunk."""
    logits = F.linear(model.output_norm(x).to(weight.dtype), weight).float()  # (N, V)
    return (torch.logsumexp(logits, -1) - logits.gather(1, y[:, None])[:, 0]).sum()


def scoring_positions(model: Transformer) -> int:
    """Positions whose logits scoring computes at once (no backward keeps them): EVAL_HEAD_CHUNKS LOGITS_CHUNKs."""
    return max(1, LOGITS_CHUNK // model.cfg.vocab_size) * EVAL_HEAD_CHUNKS


def forward_loss(model: Transformer, idx, targets, route: str, recompute: bool = False, hook=None):
    """Mean cross-entropy; the same function as `model(idx, targets, route)`, with less memory when
    `recompute`: blocks are checkpointed and the head runs in chunks of LOGITS_CHUNK logits."""
    if not recompute:
        return model(idx, targets, route=route, hook=hook)
    B, T = idx.shape
    cos, sin = rope_for(model.cfg, T, idx.device)
    x = model.tok_embd(idx)  # (B, T, C)
    for i, layer in enumerate(model.layers):
        x = _ckpt(layer, x, cos, sin, route, hook, i, use_reentrant=False)
    return head_cross_entropy(model.output_norm(x), model.output.weight, targets)  # a chunk of logits at a time


def eval_windows(tokens: np.ndarray, ctx_len: int, max_tokens: int) -> tuple[np.ndarray, int]:
    """(start of each scored window, window length): consecutive windows of a short array, windows
    spread evenly over a long one; no windows for an array too short to score."""
    N = len(tokens)
    if N < 2:
        return np.zeros(0, dtype=np.int64), 0
    win = min(ctx_len, N - 1)
    if N - 1 <= max_tokens:  # short: score it all, contiguous windows
        return np.arange((N - 1) // win) * win, win
    return np.linspace(0, N - win - 1, max(1, max_tokens // win)).round().astype(np.int64), win


@torch.no_grad()
def evaluate(model: Transformer, tokens: np.ndarray, max_tokens: int, route: str, dev, precision: str,
             hook=None, mask: np.ndarray | None = None) -> tuple[float, int]:
    """Mean loss over consecutive non-overlapping windows of up to `max_tokens` tokens; with a loss `mask`
    (data/masks.py), over the targets it counts only (a chat domain's assistant turns).

    Returns (loss, tokens scored); (nan, 0) for an array too short to score, or with nothing counted.
    """
    starts, win = eval_windows(tokens, model.cfg.ctx_len, max_tokens)
    n_win = len(starts)
    if not n_win:
        return float("nan"), 0
    bs = max(1, EVAL_ROWS // win)
    head = scoring_positions(model)
    weight = model.output.weight.detach().to(torch.bfloat16 if precision == "bf16" else model.output.weight.dtype)
    total, count = 0.0, 0
    model.eval()
    for b in range(0, n_win, bs):
        rows = [np.asarray(tokens[s : s + win + 1], dtype=np.int64) for s in starts[b : b + bs]]
        w = torch.from_numpy(np.stack(rows)).to(dev)  # (b, win+1)
        with autocast(precision, dev):
            x = model.hidden(w[:, :-1], route=route, hook=hook)  # (b, win, C)
            x, y = x.reshape(-1, x.size(-1)), w[:, 1:].reshape(-1)  # (N, C), (N,)
            if mask is not None:  # the counted targets only
                keep = target_mask(mask, starts[b : b + bs], win).reshape(-1).to(dev)
                x, y = x[keep], y[keep]
            for s in range(0, len(y), head):  # the (rows, vocab) logits a chunk at a time
                total += float(score_head(model, x[s : s + head], y[s : s + head], weight))
        count += len(y)
    return (total / count, count) if count else (float("nan"), 0)


# ---- optimizer and loop ---------------------------------------------------------------------------


def make_optimizer(named_params: dict[str, torch.nn.Parameter], tc: TrainConfig,
                   lr_scale: dict[str, float] | None = None) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices only (norms and other vectors are not decayed).

    `lr_scale` {name: factor} puts those parameters in groups of their own whose LR is factor x the
    schedule's (run_loop multiplies by each group's "lr_scale").
    """
    scale = lr_scale or {}
    groups = []
    for f in dict.fromkeys([1.0, *scale.values()]):  # factor 1 first: the groups of a plain run
        ps = [p for n, p in named_params.items() if scale.get(n, 1.0) == f]
        groups += [{"params": [p for p in ps if p.dim() >= 2], "weight_decay": tc.weight_decay, "lr_scale": f},
                   {"params": [p for p in ps if p.dim() < 2], "weight_decay": 0.0, "lr_scale": f}]
    # fused: one pass over each tensor's weight, gradient and moments instead of one per arithmetic
    # operation (the update is memory-bound); streamed.py runs the same fused kernel piece by piece
    return torch.optim.AdamW(groups, lr=tc.lr, betas=(0.9, 0.95), eps=tc.adam_eps, fused=True)


def result_meta(res: LoopResult, *, kind: str, preset: str, cfg: ModelConfig, tc: TrainConfig, info: RunInfo,
                setup: StepSetup, validation: dict, t_start: float) -> dict:
    """The metadata every module records about its training (trunk and experts alike)."""
    fresh_tokens = res.tokens_seen - res.resumed_from * tc.batch_size * cfg.ctx_len  # this process's share
    return {
        "kind": kind, "preset": preset, "config": cfg.to_dict(), "train": asdict(tc),
        "partition": info.partition, "device": setup.dev.type, "precision": setup.precision,
        "recompute": setup.recompute, "compiled": res.compiled,
        "steps": res.steps, "tokens_seen": res.tokens_seen, "epochs": res.epochs, "final_loss": res.final_loss,
        "validation_loss": validation, "validation_loss_mean": mean(validation) if validation else None,  # a round's end: none
        "train_s": res.train_s, "tokens_per_s": fresh_tokens / max(res.train_s, 1e-9),
        "resumed_from_step": res.resumed_from, "history": res.history, "wall_s": time.perf_counter() - t_start,
        "startup_s": startup_s(t_start),  # the process's start before t_start, if this is its first record
        "validation_history": res.validation_history, "validation_curve_s": res.eval_s,
    }


def run_loop(model: Transformer, named_params: dict[str, torch.nn.Parameter], data: np.ndarray, tc: TrainConfig,
             *, setup: StepSetup, ckpt: Checkpoints, drive: Drive, start_state: dict[str, dict] | None = None,
             tail: TailStats | None = None) -> LoopResult:
    """Train `named_params` of `model` on shuffled epochs of `data`'s windows, a step computed as `setup` says;
    checkpoint and resume in `ckpt.dir`; `drive`: the batch order, the validation curve, a round's end (records.py).

    `start_state` {name: {"exp_avg", "exp_avg_sq", "step"}} gives parameters AdamW moments to start
    from (an expert continuing from the branch point), unless a checkpoint is resumed. `tail` gathers
    router statistics in the steps from its `first_step` on (tailstats.py), kept in the checkpoints.
    Returns the loss and held-out histories and token counts.
    """
    impl = InMemorySteps(model, named_params, tc, setup, ckpt, start_state=start_state, tail=tail)
    validation = drive.validation

    def curve() -> dict:
        out = validation()
        model.train()  # validation() leaves the model in eval mode
        return out

    model.train()
    drive = replace(drive, validation=curve if validation else None)
    res = train_steps(impl, data, tc, drive, ctx_len=model.cfg.ctx_len)
    res.compiled = impl.compiled
    return res


class InMemorySteps:
    """The in-memory step (autograd over the model, global-norm clip, AdamW) and its checkpoints:
    every `ckpt_every` steps and at the end of a sync round (driver.Steps)."""

    def __init__(self, model: Transformer, named_params: dict[str, torch.nn.Parameter], tc: TrainConfig,
                 setup: StepSetup, ckpt: Checkpoints, *, start_state: dict | None = None,
                 tail: TailStats | None = None):
        self.model, self.named, self.tc = model, named_params, tc
        self.dev, self.prec, self.route, self.recompute = setup.dev, setup.precision, setup.route, setup.recompute
        self.micro = setup.micro or tc.batch_size  # the step accumulates batch_size / micro
        self.ckpt, self.saved_at = ckpt, time.perf_counter()
        self.tail = tail
        self.params = list(named_params.values())
        self.opt = make_optimizer(named_params, tc, setup.lr_scale)
        for name, st in (start_state or {}).items():  # a checkpoint, when resumed, replaces these
            p = named_params[name]
            self.opt.state[p] = {"step": torch.tensor(float(st["step"]), dtype=torch.float32, device=p.device),
                                 "exp_avg": st["exp_avg"].to(p.device, p.dtype).reshape(p.shape).clone(),
                                 "exp_avg_sq": st["exp_avg_sq"].to(p.device, p.dtype).reshape(p.shape).clone()}
        self.steps = schedule_steps(tc, model.cfg.ctx_len)
        self.compiled = False
        self._fwd = None  # the model's training forward: compiled or eager, chosen once the steps to run are known

    def resume(self) -> dict | None:
        ck = self.ckpt
        state = ckpt_io.load(ck.dir, self.named, self.opt, ck.resume_from or ck.meta, ck.keep)
        if state and self.tail:
            self.tail.load_state(ckpt_io.load_extra(ck.dir, TAIL_PREFIX))
        # decided by the whole schedule (every round of it), not what is left: a resumed run, and each round of a
        # synced one, computes exactly as an uninterrupted run does
        work = matmul_work(self.model, self.steps, self.tc.batch_size * self.model.cfg.ctx_len)
        self.compiled = wants_compile(self.tc.compile, work, self.recompute)
        self._fwd = torch.compile(self.model, dynamic=False) if self.compiled else self.model
        return state

    def step(self, step: int, x, y, lr: float) -> float:
        x, y = x.to(self.dev), y.to(self.dev)
        for g in self.opt.param_groups:
            g["lr"] = lr * g["lr_scale"]
        hook = self.tail.hook if self.tail and self.tail.active(step) else None
        try:
            loss = self._forward_backward(x, y, hook)
        except Exception as e:  # noqa: BLE001  (a compiler that fails here, e.g. no C++ toolchain: train eagerly)
            if not self.compiled or self.tc.compile == "on":
                raise
            print(f"warning: torch.compile failed ({type(e).__name__}: {str(e).splitlines()[0][:120]});"
                  " training without it (--compile off skips the attempt)", file=sys.stderr)
            self.compiled, self._fwd = False, self.model
            self.opt.zero_grad(set_to_none=True)
            loss = self._forward_backward(x, y, hook)
        torch.nn.utils.clip_grad_norm_(self.params, self.tc.grad_clip)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return float(loss.detach())

    def _forward_backward(self, x, y, hook=None) -> torch.Tensor:
        """Mean loss of the batch; its gradient accumulated over micro-batches of `micro` sequences
        (x: (B, T), B a multiple of micro), so activations are held for one micro-batch at a time.
        `hook` (the tail statistics) sees every layer's FFN input; a compiled forward runs eagerly then."""
        total = 0.0
        # One autocast region for the whole step: each trainable weight is cast to bf16 once a step,
        # not once a micro-batch (the weights change only at the optimizer step).
        with autocast(self.prec, self.dev):
            for s in range(0, x.shape[0], self.micro):
                xm, ym = x[s : s + self.micro], y[s : s + self.micro]  # (micro, T)
                if self.recompute:
                    loss = forward_loss(self.model, xm, ym, self.route, recompute=True, hook=hook)
                elif hook is not None:
                    loss = self.model(xm, ym, route=self.route, hook=hook)
                else:
                    loss = self._fwd(xm, ym, route=self.route)
                with autocast_off(self.prec, self.dev):
                    (loss * counted_share(ym, y)).backward()
                total = total + loss.detach() * counted_share(ym, y)
                if hook is not None:
                    self.tail.commit()
        return total

    def settle(self) -> None:
        pass  # the optimizer step already ran

    def checkpoint(self, step: int, state: dict, last: bool) -> None:
        # a round that ends before the schedule does keeps its state: the next round resumes from it after `sync`
        every_s = self.ckpt.every_s
        due = every_s is not None and time.perf_counter() - self.saved_at >= every_s
        if (last and step < self.steps) or (not last and (step % self.tc.ckpt_every == 0 or due)):
            ckpt_io.save(self.ckpt.dir, self.named, self.opt, {**self.ckpt.meta, **state},
                         extra=self.tail.state_tensors() if self.tail else None)
            self.saved_at = time.perf_counter()

    def branch(self, step: int, state: dict) -> None:
        if self.ckpt.branch_path is not None:
            from mfgguf.train.whole.branch import save_in_memory

            save_in_memory(self.ckpt.branch_path, self.named, self.opt, {**self.ckpt.meta, **state})

    def finish(self) -> None:
        pass


COMPILE_MIN_FLOPS = 2e13  # auto compiles a schedule of at least this much matmul work (all its rounds together): a
#                           cold compile costs about a minute on 2 cores and inductor's cache makes every later one
#                           of the same shape a few seconds, so a run of experts of one shape pays it once, and a
#                           tiny preset's runs stay eager (docs/benchmarks.md, "Figures behind the defaults")


def matmul_work(model: torch.nn.Module, steps: int, tokens_per_step: int) -> float:
    """The schedule's matmul FLOPs, estimated as 4 per weight per token (the forward's 2 and the input
    gradient's 2; weight gradients left out, as most weights are frozen in an expert's step)."""
    weights = sum(p.numel() for p in model.parameters() if p.dim() == 2)
    return 4.0 * weights * steps * tokens_per_step


def wants_compile(choice: str, work: float, recompute: bool) -> bool:
    """Whether the in-memory step runs through torch.compile: `choice` on/off, or auto (a schedule of at
    least COMPILE_MIN_FLOPS of `work`, without recompute: the checkpointed blocks and chunked head stay eager)."""
    if choice == "auto":
        return not recompute and work >= COMPILE_MIN_FLOPS
    return choice == "on" and not recompute


def validation_losses(test_dir: Path, model: Transformer, max_tokens: int, route: str, dev, precision: str) -> dict:
    """{domain: mean loss} over `data/test/<domain>.npy`, up to `max_tokens` tokens each (a chat domain's:
    over its assistant turns, the targets its loss mask counts)."""
    out = {}
    for f in sorted(Path(test_dir).glob("*.npy")):
        tokens = load_tokens(f, f"held-out tokens of {f.stem}")
        loss, n = evaluate(model, tokens, max_tokens, route, dev, precision, mask=load_mask(f, len(tokens)))
        if n:
            out[f.stem] = loss
    return out


def mean(d: dict) -> float:
    """Mean of a dict's values (NaN when empty)."""
    return float(sum(d.values()) / len(d)) if d else float("nan")


def check_token_range(tokens: np.ndarray, vocab_size: int, what: str) -> None:
    """Every token id must index the embedding: a clear error instead of an IndexError deep in torch."""
    top = int(tokens.max()) if len(tokens) else 0
    if top >= vocab_size:
        raise MfggufError(f"{what} holds token id {top} >= vocab size {vocab_size}; re-create the run with `mfgguf prepare`")
