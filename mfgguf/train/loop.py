"""The training loop shared by the trunk and the experts: data windows, schedule, AdamW, checkpoints.

Exact resume is a design property, not a feature bolted on: the batch at step s is drawn from a
generator seeded by (seed, stream, s), so it does not depend on history; the only state is the
trainable parameters, AdamW's moments and the loss history, all of which a checkpoint holds.

Memory: with `recompute=True` each block's activations are recomputed in the backward pass
(only block inputs are kept) and the output head + cross-entropy run in chunks, so a frozen
1B-parameter trunk trains an expert in little more memory than its bf16 weights.
"""

from __future__ import annotations

import ctypes
import math
import os
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint as _ckpt

from ..config import ModelConfig, TrainConfig
from ..errors import MfggufError
from ..model import Transformer, rope_tables
from . import checkpoint as ckpt_io
from .status import StatusFile

LOGITS_CHUNK = 1 << 22  # logits elements per chunk of the output head when recomputing (16 MB in f32)
_BF16_CPU: bool | None = None  # probed once


# ---- device and precision ------------------------------------------------------------------------


def resolve_device(device: str) -> torch.device:
    """'cpu' or 'cuda' (clear error when CUDA is not available)."""
    if device == "cpu":
        torch.set_num_threads(os.cpu_count() or 1)
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


def limit_heap_retention(threshold: int = 1 << 20) -> None:
    """Make glibc return freed activation buffers to the OS.

    glibc raises its mmap threshold each time a large block is freed, after which activation-sized
    buffers come from the heap and stay resident once freed: +500 MB of RSS on a `1b` expert. A
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


def get_batch(tokens: np.ndarray, seed: int, stream: int, step: int, batch_size: int, ctx_len: int):
    """Random windows of ctx_len+1 tokens; a pure function of (seed, stream, step)."""
    n = len(tokens)
    if n < ctx_len + 2:
        raise MfggufError(f"only {n} training tokens, fewer than one context of {ctx_len + 1}; add data")
    rng = np.random.default_rng([seed, stream, step])
    starts = rng.integers(0, n - ctx_len - 1, size=batch_size)
    w = np.stack([np.asarray(tokens[s : s + ctx_len + 1], dtype=np.int64) for s in starts])  # (B, T+1)
    w = torch.from_numpy(w)
    return w[:, :-1], w[:, 1:]  # (B, T), (B, T)


def schedule_steps(tc: TrainConfig, ctx_len: int) -> int:
    """Optimizer steps of a whole run: its LR schedule's length (sync rounds cut it, never resize it)."""
    return max(1, tc.tokens // (tc.batch_size * ctx_len))


def lr_at(step: int, steps: int, tc: TrainConfig) -> float:
    """Linear warm-up, then cosine from lr down to lr * min_lr_frac."""
    warm = max(1, int(round(tc.warmup_frac * steps)))
    if step < warm:
        return tc.lr * (step + 1) / warm
    t = (step - warm) / max(1, steps - warm)
    return tc.lr * (tc.min_lr_frac + (1 - tc.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * min(1.0, t))))


# ---- forward with optional recompute and chunked loss ---------------------------------------------


def _head_loss_sum(model: Transformer, x, y):  # x: (N, C), y: (N,) -> summed cross-entropy
    logits = model.output(model.output_norm(x))  # (N, V)
    return F.cross_entropy(logits.float(), y, reduction="sum")


def forward_loss(model: Transformer, idx, targets, route: str, recompute: bool = False, hook=None):
    """Mean cross-entropy; the same function as `model(idx, targets, route)`, with less memory when
    `recompute`: blocks are checkpointed and the head runs in chunks of LOGITS_CHUNK logits."""
    if not recompute:
        return model(idx, targets, route=route, hook=hook)
    B, T = idx.shape
    cos, sin = rope_tables(model.cfg.head_dim, T, model.cfg.rope_theta, idx.device)
    x = model.tok_embd(idx)  # (B, T, C)
    for i, layer in enumerate(model.layers):
        x = _ckpt(layer, x, cos, sin, route, hook, i, use_reentrant=False)
    x, y = x.reshape(B * T, -1), targets.reshape(-1)  # (N, C), (N,)
    step = max(1, LOGITS_CHUNK // model.cfg.vocab_size)
    total = 0.0
    for s in range(0, B * T, step):
        total = total + _ckpt(_head_loss_sum, model, x[s : s + step], y[s : s + step], use_reentrant=False)
    return total / (B * T)


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
             hook=None) -> tuple[float, int]:
    """Mean loss over consecutive non-overlapping windows of up to `max_tokens` tokens.

    Returns (loss, tokens scored); (nan, 0) for an array too short to score.
    """
    starts, win = eval_windows(tokens, model.cfg.ctx_len, max_tokens)
    n_win = len(starts)
    if not n_win:
        return float("nan"), 0
    bs = max(1, LOGITS_CHUNK // (win * model.cfg.vocab_size))  # bound the logits held at once
    total, count = 0.0, 0
    model.eval()
    for b in range(0, n_win, bs):
        rows = [np.asarray(tokens[s : s + win + 1], dtype=np.int64) for s in starts[b : b + bs]]
        w = torch.from_numpy(np.stack(rows)).to(dev)  # (b, win+1)
        with autocast(precision, dev):
            loss = model(w[:, :-1], w[:, 1:], route=route, hook=hook)
        total += float(loss) * w[:, 1:].numel()
        count += w[:, 1:].numel()
    return total / count, count


# ---- optimizer and loop ---------------------------------------------------------------------------


def make_optimizer(named_params: dict[str, torch.nn.Parameter], tc: TrainConfig, dev,
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
    return torch.optim.AdamW(groups, lr=tc.lr, betas=(0.9, 0.95), eps=1e-8, foreach=dev.type == "cuda")


@dataclass
class LoopResult:
    steps: int
    tokens_seen: int
    final_loss: float
    history: list = field(default_factory=list)  # [[step, tokens, loss], ...]
    heldout_history: list = field(default_factory=list)  # [[step, tokens, {domain: loss}], ...]
    eval_s: float = 0.0  # seconds spent on the held-out curve this process (not in train_s)
    train_s: float = 0.0  # seconds spent in training steps this process (not eval, not load)
    resumed_from: int = 0


def result_meta(res: LoopResult, *, kind: str, preset: str, cfg: ModelConfig, tc: TrainConfig, info: dict, dev,
                precision: str, recompute: bool, heldout: dict, t_start: float) -> dict:
    """The metadata every module records about its training (trunk and experts alike)."""
    fresh_tokens = res.tokens_seen - res.resumed_from * tc.batch_size * cfg.ctx_len  # this process's share
    return {
        "kind": kind, "preset": preset, "config": cfg.to_dict(), "train": asdict(tc),
        "partition": info.get("partition"), "device": dev.type, "precision": precision, "recompute": recompute,
        "steps": res.steps, "tokens_seen": res.tokens_seen, "final_loss": res.final_loss,
        "heldout_loss": heldout, "heldout_loss_mean": mean(heldout),
        "train_s": res.train_s, "tokens_per_s": fresh_tokens / max(res.train_s, 1e-9),
        "resumed_from_step": res.resumed_from, "history": res.history, "wall_s": time.perf_counter() - t_start,
        "heldout_history": res.heldout_history, "heldout_curve_s": res.eval_s,
    }


def run_loop(model: Transformer, named_params: dict[str, torch.nn.Parameter], data: np.ndarray, tc: TrainConfig,
             *, dev, precision: str, route: str, stream: int, ckpt_dir: Path, ckpt_meta: dict,
             recompute: bool = False, progress: bool = True, label: str = "train",
             heldout: Callable[[], dict] | None = None, lr_scale: dict[str, float] | None = None,
             until: int | None = None, keep: frozenset[str] = frozenset(),
             resume_from: dict | None = None) -> LoopResult:
    """Train `named_params` of `model` on random windows of `data`; checkpoint and resume in `ckpt_dir`.

    `ckpt_meta` (config, trunk sha...) must match a checkpoint found there, else an error says how to
    start over. `heldout()` ({domain: loss}), when given, is recorded every `tc.eval_every` steps and
    after the last one: the held-out curve, kept in checkpoints like the loss history. `lr_scale`
    {name: factor} scales some parameters' LR (make_optimizer). `until` stops after that many of the
    schedule's steps (a sync round: the LR schedule still spans the whole run) and checkpoints
    there; `keep` names parameters a resumed checkpoint must not overwrite (checkpoint.load), and
    `resume_from` is what that checkpoint must match instead of `ckpt_meta` (the previous round's).
    Returns the loss and held-out histories and token counts.
    """
    cfg: ModelConfig = model.cfg
    per_step = tc.batch_size * cfg.ctx_len
    steps = schedule_steps(tc, cfg.ctx_len)
    params = list(named_params.values())
    opt = make_optimizer(named_params, tc, dev, lr_scale)
    end = steps if until is None else min(steps, until)
    state = ckpt_io.load(ckpt_dir, named_params, opt, resume_from or ckpt_meta, keep)
    start, history = (state["step"], state["history"]) if state else (0, [])
    curve = state.get("heldout_history", []) if state else []
    eval_s = 0.0

    def record(step: int) -> None:  # one held-out curve point after `step` steps
        nonlocal eval_s
        t = time.perf_counter()
        curve.append([step, step * per_step, heldout()])
        model.train()  # heldout() leaves the model in eval mode
        eval_s += time.perf_counter() - t

    bar = _Progress(label, end * per_step, start * per_step) if progress else None
    status = StatusFile.from_env()  # a scheduler's live view (train-experts), when it asked for one
    model.train()
    t0, tok0 = time.perf_counter(), start * per_step
    try:
        for step in range(start, end):
            x, y = get_batch(data, tc.seed, stream, step, tc.batch_size, cfg.ctx_len)
            x, y = x.to(dev), y.to(dev)
            lr = lr_at(step, steps, tc)
            for g in opt.param_groups:
                g["lr"] = lr * g["lr_scale"]
            with autocast(precision, dev):
                loss = forward_loss(model, x, y, route, recompute)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, tc.grad_clip)
            opt.step()
            opt.zero_grad(set_to_none=True)
            lv = float(loss.detach())
            if not math.isfinite(lv):
                raise MfggufError(f"training diverged at step {step} (loss {lv}); lower --lr and pass --restart")
            history.append([step + 1, (step + 1) * per_step, lv])
            if bar:
                bar.update((step + 1) * per_step, lv, time.perf_counter() - t0, (step + 1) * per_step - tok0)
            if status:
                status.update(label=label, step=step + 1, steps=end, tokens=(step + 1) * per_step, total=end * per_step,
                              loss=round(lv, 4), tokens_per_s=((step + 1) * per_step - tok0) / max(time.perf_counter() - t0, 1e-9))
            if heldout and tc.eval_every and (step + 1) % tc.eval_every == 0 and step + 1 < end:
                record(step + 1)  # before the checkpoint, so a resumed run has this point too
            if (step + 1) % tc.ckpt_every == 0 and step + 1 < end:
                ckpt_io.save(ckpt_dir, named_params, opt,
                             {**ckpt_meta, "step": step + 1, "history": history, "heldout_history": curve})
    finally:
        if bar:
            bar.close()
    train_s = time.perf_counter() - t0 - eval_s
    if heldout and (not curve or curve[-1][0] != end):
        record(end)
    if end < steps:  # the round's state: the next round resumes from it after `mfgguf sync`
        ckpt_io.save(ckpt_dir, named_params, opt, {**ckpt_meta, "step": end, "history": history, "heldout_history": curve})
    return LoopResult(steps=end, tokens_seen=end * per_step, final_loss=_smooth(history), history=history,
                      heldout_history=curve, eval_s=eval_s, train_s=train_s, resumed_from=start)


def _smooth(history: list, n: int = 10) -> float:
    """Mean of the last n step losses: a less noisy final loss than the last step alone."""
    tail = [h[2] for h in history[-n:]]
    return float(sum(tail) / len(tail)) if tail else float("nan")


class _Progress:
    """A rich progress bar over tokens, with loss and tokens/s."""

    def __init__(self, label: str, total: int, done: int):
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        self.p = Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                          TextColumn("loss {task.fields[loss]}"), TextColumn("{task.fields[tps]} tok/s"),
                          TimeRemainingColumn())
        self.p.start()
        self.task = self.p.add_task(label, total=total, completed=done, loss="-", tps="-")

    def update(self, done: int, loss: float, dt: float, tokens: int):
        self.p.update(self.task, completed=done, loss=f"{loss:.3f}", tps=f"{tokens / max(dt, 1e-9):,.0f}")

    def close(self):
        self.p.stop()


def heldout_losses(heldout_dir: Path, model: Transformer, max_tokens: int, route: str, dev, precision: str) -> dict:
    """{domain: mean loss} over `data/heldout/<domain>.npy`, up to `max_tokens` tokens each."""
    out = {}
    for f in sorted(Path(heldout_dir).glob("*.npy")):
        loss, n = evaluate(model, load_tokens(f, f"held-out tokens of {f.stem}"), max_tokens, route, dev, precision)
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
