"""The one training driver: batches, LR schedule, loss history, held-out curve, progress and status.

What a step *is* differs between in-memory training (loop.py: autograd over the whole model, AdamW,
a checkpoint every `ckpt_every` steps) and layer-streamed training (streamed.py: one unit in RAM,
every step a checkpoint); what happens around it does not, and lives here once. A `Steps` object
supplies the step; `train_steps` drives it.

The order around each step is fixed, because resuming exactly depends on it: the step; its loss in
the history; at a curve point, the weights made current (`settle`) and the validation curve recorded;
then the checkpoint, which holds both histories.

Example:
    >>> res = train_steps(steps_impl, data, tc, Drive(stream=0, label="trunk", progress=False), ctx_len=256)
    >>> res.history[-1]  # [step, tokens, loss]
"""

from __future__ import annotations

import functools
import math
import time
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch

from mfgguf.config import TrainConfig
from mfgguf.data.masks import mask_targets
from mfgguf.errors import MfggufError
from mfgguf.run.legacy import renamed
from mfgguf.train.engine.records import Drive
from mfgguf.train.engine.status import StatusFile


# ---- data and schedule -----------------------------------------------------------------------------


def get_batch(tokens: np.ndarray, seed: int, stream: int, step: int, batch_size: int, ctx_len: int):
    """Step `step`'s windows of ctx_len+1 tokens: the next `batch_size` of the epochs `window_starts` orders;
    a pure function of (seed, stream, step), so a resumed run draws the very batches it would have."""
    n = len(tokens)
    if n < ctx_len + 1:  # one window fits exactly (check_shards refuses the same shards up front)
        raise MfggufError(f"only {n} training tokens, fewer than one context of {ctx_len + 1}; add data")
    starts = window_starts(n, ctx_len, seed, stream, np.arange(step * batch_size, (step + 1) * batch_size))
    w = np.stack([np.asarray(tokens[s : s + ctx_len + 1], dtype=np.int64) for s in starts])  # (B, T+1)
    w = torch.from_numpy(w)
    return w[:, :-1], w[:, 1:]  # (B, T), (B, T)


def window_starts(n: int, ctx_len: int, seed: int, stream: int, g: np.ndarray) -> np.ndarray:
    """Start offsets of global windows `g` (step * batch + b) over n tokens: epoch after epoch, each a shuffled pass
    over a grid of windows ctx_len apart, so within an epoch every target token is predicted once (a window's last
    token is the next one's first input), not drawn with replacement, which leaves a good share of a pass's tokens
    unseen.

    Epoch 0 lays its grid from token 0: the most windows that fit, missing under ctx_len tail tokens. Later epochs
    shift their grid by an offset drawn with their order, so a token is predicted at another place in its window,
    after other context, than the pass before; room for any shift costs them one window fewer where the shard's
    length leaves no slack, so each misses under two windows' worth, at its two edges and a different place every
    epoch, and a shard too short for two windows is one window at a random offset.
    """
    first, later = grid_sizes(n, ctx_len)
    g = np.asarray(g, dtype=np.int64)
    epoch = np.where(g < first, 0, 1 + (g - first) // later)  # (B,)
    index = np.where(g < first, g, (g - first) % later)  # (B,) window within its epoch
    out = np.empty(g.shape, dtype=np.int64)
    for e in np.unique(epoch):  # a batch straddles an epoch's end at most once, unless the shard is tiny
        offset, order = epoch_grid(n, ctx_len, seed, stream, int(e))
        sel = epoch == e
        out[sel] = offset + order[index[sel]].astype(np.int64) * ctx_len
    return out


# a few entries: the current epoch and the next (a batch may straddle them) of a stream or two; drawing the
# permutation afresh every step would cost a pass over the shard's windows per step
@functools.lru_cache(maxsize=4)
def epoch_grid(n: int, ctx_len: int, seed: int, stream: int, epoch: int) -> tuple[int, np.ndarray]:
    """(grid offset, window order) of one epoch: window k of the epoch starts at offset + order[k] * ctx_len."""
    rng = np.random.default_rng([seed, stream, epoch])
    count = grid_sizes(n, ctx_len)[epoch > 0]
    offset = 0 if epoch == 0 else int(rng.integers(0, n - 1 - count * ctx_len + 1))  # keeps the last window in the shard
    return offset, _order(rng, count)


def grid_sizes(n: int, ctx_len: int) -> tuple[int, int]:
    """Windows in epoch 0 and in every later epoch of an n-token shard."""
    # later epochs leave at least ctx_len-1 tokens of slack: room for every shift of the grid
    return (n - 1) // ctx_len, max(1, (n - ctx_len) // ctx_len)


def _order(rng: np.random.Generator, count: int) -> np.ndarray:
    """A shuffled 0..count-1, int32 where it fits (a billion-token shard's orders, cached, stay small)."""
    return rng.permutation(count).astype(np.int32 if count < 2**31 else np.int64)  # (count,)


def epochs_of(tokens: int, n: int) -> float:
    """Passes over n tokens of data that `tokens` training tokens make (the module JSON's `epochs`)."""
    return round(tokens / max(1, n), 3)


def schedule_steps(tc: TrainConfig, ctx_len: int) -> int:
    """Optimizer steps of a whole run: its LR schedule's length (sync rounds cut it, never resize it)."""
    return max(1, tc.tokens // (tc.batch_size * ctx_len))


def check_schedule(tc: TrainConfig) -> None:
    """A one-line error for a --cooldown that leaves no room for the warm-up (TrainConfig checked --schedule)."""
    if tc.schedule == "wsd" and not (0.0 <= tc.cooldown <= 1.0 and tc.warmup_frac + tc.cooldown <= 1.0):
        raise MfggufError(f"--cooldown {tc.cooldown} must be in [0, 1] and leave room for --warmup-frac"
                          f" {tc.warmup_frac} (their sum at most 1)")


def cooldown_start(steps: int, tc: TrainConfig) -> int | None:
    """wsd: the step at which the cooldown begins (the branch point: the state after this many steps);
    None for cosine. The cooldown is the last round(cooldown x steps) steps."""
    if tc.schedule != "wsd":
        return None
    return steps - int(round(tc.cooldown * steps))


def lr_at(step: int, steps: int, tc: TrainConfig) -> float:
    """The LR of step `step` (0-based) of a `steps`-step run.

    cosine: linear warm-up, then cosine from lr down to lr * min_lr_frac.
    wsd: the same warm-up, then lr held (stable), then over the last `cooldown` share of the steps a
    1-sqrt decay to lr * min_lr_frac, which the last step reaches. 1-sqrt, not linear: in arXiv
    2405.18392 (Hagele et al.) it gave a lower final loss than a linear cooldown of the same length,
    and a 20% cooldown matched cosine. A warm-up of 0 starts at lr (an expert at the branch LR).
    """
    warm = max(1, int(round(tc.warmup_frac * steps)))
    cool = cooldown_start(steps, tc)
    if cool is not None and step >= cool:  # wsd cooldown: t in (0, 1], 1 at the last step
        t = min(1.0, (step - cool + 1) / (steps - cool))
        return tc.lr * (tc.min_lr_frac + (1 - tc.min_lr_frac) * (1 - math.sqrt(t)))
    if step < warm:
        return tc.lr * (step + 1) / warm
    if cool is not None:
        return tc.lr  # wsd: stable
    t = (step - warm) / max(1, steps - warm)
    return tc.lr * (tc.min_lr_frac + (1 - tc.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * min(1.0, t))))


# ---- the driver ------------------------------------------------------------------------------------


class Steps(Protocol):
    """One kind of training step, and its checkpoint."""

    def resume(self) -> dict | None:
        """The checkpoint's state ({"step", "history", "validation_history"}), or None to start at step 0."""

    def step(self, step: int, x: torch.Tensor, y: torch.Tensor, lr: float) -> float:
        """Train on batch (x, y) at schedule LR `lr`; return the batch's mean loss."""

    def settle(self) -> None:
        """Make the weights the last step produced current (before the validation curve reads them)."""

    def checkpoint(self, step: int, state: dict, last: bool) -> None:
        """After `step` steps: keep `state` (histories included) as a checkpoint where this kind keeps one.
        `last`: the run (or its round) ends here."""

    def branch(self, step: int, state: dict) -> None:
        """wsd: after `step` steps the cooldown begins; keep the weights and AdamW state as the branch
        point where this kind keeps one (the trunk: branch.py)."""

    def finish(self) -> None:
        """Wait for any work still in flight."""


@dataclass
class LoopResult:
    steps: int
    tokens_seen: int
    final_loss: float
    history: list = field(default_factory=list)  # [[step, tokens, loss], ...]
    validation_history: list = field(default_factory=list)  # [[step, tokens, {domain: loss}], ...]
    eval_s: float = 0.0  # seconds spent on the validation curve this process (not in train_s)
    train_s: float = 0.0  # seconds spent in training steps this process (not eval, not load, not checkpoint saves)
    ckpt_s: float = 0.0  # seconds spent writing checkpoints this process (not in train_s)
    resumed_from: int = 0
    train_s_before: float = 0.0  # training seconds of the processes this one resumed (their checkpoint's count)
    io_per_step: list | None = None  # streamed: [bytes read, bytes written] by the last step
    compiled: bool = False  # the step ran through torch.compile
    epochs: float = 0.0  # passes over its data that tokens_seen makes (epochs_of)


def train_steps(impl: Steps, data: np.ndarray, tc: TrainConfig, drive: Drive, *, ctx_len: int) -> LoopResult:
    """Drive `impl` over the schedule's steps (up to `drive.until`, a sync round's end) on shuffled epochs of
    `data`'s windows (get_batch). The validation curve is not recorded at a round's end: nothing is decided on a
    round's score (docs/benchmarks.md, the recipe's wall). The mask leaves the targets it zeroes out of every
    step's loss."""
    stream, label, progress, validation, until, mask = (drive.stream, drive.label, drive.progress, drive.validation,
                                                         drive.until, drive.mask)
    check_schedule(tc)
    per_step = tc.batch_size * ctx_len
    steps = schedule_steps(tc, ctx_len)
    branch_at = cooldown_start(steps, tc)  # wsd: the branch point, kept before that step's checkpoint
    end = steps if until is None else min(steps, until)
    state = impl.resume()
    state = renamed(state) if state else state  # a checkpoint written before the curve had its name
    start, history = (state["step"], state["history"]) if state else (0, [])
    before = float(state.get("train_s_total", 0.0)) if state else 0.0  # absent from checkpoints older than the key
    curve = state.get("validation_history", []) if state else []
    eval_s = ckpt_s = 0.0

    def record(step: int) -> None:  # one validation curve point after `step` steps
        nonlocal eval_s
        t = time.perf_counter()
        curve.append([step, step * per_step, validation()])
        eval_s += time.perf_counter() - t

    bar = Progress(label, end * per_step, start * per_step) if progress else None
    status = StatusFile.from_env()  # a scheduler's live view (train-experts), when it asked for one
    t0, tok0 = time.perf_counter(), start * per_step
    try:
        if branch_at == 0 and start == 0:  # all cooldown: the branch point is the initial state
            impl.branch(0, {"step": 0, "tokens": 0, "lr": tc.lr, "steps": steps})
        for step in range(start, end):
            x, y = get_batch(data, tc.seed, stream, step, tc.batch_size, ctx_len)
            if mask is not None:  # the mask's windows at the same starts: get_batch draws them from the length alone
                y = mask_targets(y, get_batch(mask, tc.seed, stream, step, tc.batch_size, ctx_len)[1])
            lv = impl.step(step, x, y, lr_at(step, steps, tc))
            if not math.isfinite(lv):
                raise MfggufError(f"training diverged at step {step} (loss {lv}); lower --lr and pass --restart")
            done = step + 1
            history.append([done, done * per_step, lv])
            if validation and (done == steps or (tc.eval_every and done % tc.eval_every == 0)):
                impl.settle()
                record(done)  # before the checkpoint, so a resumed run (or the next round) has this point too
            if done == branch_at:
                impl.branch(done, {"step": done, "tokens": done * per_step, "lr": tc.lr, "steps": steps})
            t_ck = time.perf_counter()
            impl.checkpoint(done, {"step": done, "history": list(history), "validation_history": list(curve),
                                   "train_s_total": before + t_ck - t0 - eval_s - ckpt_s}, last=done == end)
            ckpt_s += time.perf_counter() - t_ck  # a whole model's save takes seconds: not a step's speed
            tokens, dt = done * per_step, time.perf_counter() - t0
            if bar:
                bar.update(tokens, lv, dt, tokens - tok0)
            if status:
                status.update(label=label, step=done, steps=end, tokens=tokens, total=end * per_step,
                              loss=round(lv, 4), tokens_per_s=(tokens - tok0) / max(dt, 1e-9))
        impl.finish()
    finally:
        if bar:
            bar.close()
    train_s = time.perf_counter() - t0 - eval_s - ckpt_s
    if validation and end == steps and (not curve or curve[-1][0] != end):  # resumed at the very end: nothing ran
        record(end)
    return LoopResult(steps=end, tokens_seen=end * per_step, final_loss=smooth(history), history=history,
                      validation_history=curve, eval_s=eval_s, train_s=train_s, ckpt_s=ckpt_s, resumed_from=start,
                      train_s_before=before, epochs=epochs_of(end * per_step, len(data)))


def smooth(history: list, n: int = 10) -> float:
    """Mean of the last n step losses: a less noisy final loss than the last step alone."""
    tail = [h[2] for h in history[-n:]]
    return float(sum(tail) / len(tail)) if tail else float("nan")


class Progress:
    """A rich progress bar over tokens, with loss, tokens/s and the time left (a loss of None shows "-",
    for passes that score rather than train; `stderr` keeps stdout clean for a verb's JSON)."""

    def __init__(self, label: str, total: int, done: int, *, stderr: bool = False):
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress as RichProgress, TextColumn, TimeRemainingColumn

        self.p = RichProgress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                              TextColumn("loss {task.fields[loss]}"), TextColumn("{task.fields[tps]} tok/s"),
                              TimeRemainingColumn(), console=Console(stderr=True) if stderr else None)
        self.p.start()
        self.task = self.p.add_task(label, total=total, completed=done, loss="-", tps="-")

    def update(self, done: int, loss: float | None, dt: float, tokens: int, label: str | None = None):
        fields = {"description": label} if label is not None else {}
        self.p.update(self.task, completed=done, loss="-" if loss is None else f"{loss:.3f}",
                      tps=f"{tokens / max(dt, 1e-9):,.0f}", **fields)

    def close(self):
        self.p.stop()
