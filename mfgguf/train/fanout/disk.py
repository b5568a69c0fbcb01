"""The disk a `train-experts` command will write, counted from the shapes before anything trains, and the check
that it fits.

What the jobs left (plan.py) write, from the trunk's shape and the options, nothing measured:
  - modules:      each job's module file (FFN, router means, and with --shared its private copies of the
                  trunk tensors) and its JSON record (the loss history is in it). With sync rounds every
                  round's module stays (the sync keeps its inputs under RUN/rounds/), and the final sync
                  writes each expert's FFN and statistics once more;
  - checkpoints:  parameters and both AdamW moments (f32), the training statistics. Without rounds a
                  checkpoint lives while its job runs; with rounds each expert keeps its own until its
                  last round. A save writes the new one beside the old before the rename: twice per job
                  running;
  - moments:      each expert's per-layer second moments of its last steps (upper triangles, f32), which the
                  router's pooled statistics take instead of a pass: beside the module for good, or with
                  --shared and rounds until the final sync (none with --shared and one round, or
                  --stats-from pass);
  - syncs:        each sync's merged trunk (the one before it stays under RUN/rounds/);
  - the rest:     the pooled router statistics, a loss plot and a log per job.
Their sum over-counts a run with rounds (its checkpoints are gone before its last modules are written), so
the total is the larger of the two moments that hold the most. The check compares it with the free space
of RUN's filesystem less `keep_free`, and refuses in one line.

Example:
    >>> need = estimate(plan, workers=1)
    >>> check_disk(Path("RUN"), need, keep_free=1 << 30)   # MfggufError when it cannot fit
"""

from __future__ import annotations

import shutil
from pathlib import Path

from mfgguf.config import shared_tensor_names
from mfgguf.errors import MfggufError
from mfgguf.train.fanout.plan import RunPlan

F32 = 4
JSON_PER_STEP = 64  # bytes of one loss-history entry in a module's JSON and a checkpoint's header, rounded up
JSON_FIXED = 64 << 10  # the rest of a module's JSON (its held-out curve, options, shapes), rounded up
PER_TENSOR = 256  # a safetensors header's entry for one tensor, rounded up
PLOT_AND_LOG = 256 << 10  # one job's loss plot (PNG) and log file, rounded up from the largest written so far


def _bytes(shape) -> int:
    n = F32
    for d in shape:
        n *= int(d)
    return n


def _shared(plan: RunPlan) -> int:
    """Bytes of the private trunk copies a job trains (0 without --shared)."""
    shapes = plan.trunk.tensors
    return sum(_bytes(shapes[n]) + PER_TENSOR for n in shared_tensor_names(plan.cfg, plan.tc.shared) if n in shapes)


def _ffn(plan: RunPlan) -> int:
    """Bytes of one expert's FFN and router means."""
    c = plan.cfg
    per_layer = 3 * c.dim * c.expert_ff * F32 + 2 * c.dim * F32 + 4 * PER_TENSOR
    return c.n_layers * per_layer


def _moments(plan: RunPlan) -> int:
    """Per-layer (dim, dim) f32 matrices: the pooled router statistics' file; half of a checkpoint's float64 moments."""
    return plan.cfg.n_layers * plan.cfg.dim * plan.cfg.dim * F32


def _moments_file(plan: RunPlan) -> int:
    """One expert's moments file: each layer's upper triangle in f32 (tailstats.write_moments)."""
    c = plan.cfg
    return c.n_layers * (c.dim * (c.dim + 1) // 2 * F32 + PER_TENSOR)


def estimate(plan: RunPlan, workers: int) -> dict[str, int]:
    """Bytes the jobs of `plan` will add to RUN, by what writes them (each at its own peak), and "total": the most
    they hold at once. `workers` jobs run at once. With rounds the peak is at the start of the last round (every
    expert's checkpoint, every earlier round's modules) or at the end (every module, the moments, the final
    sync's rewrite), whichever is larger; checkpoints that are on disk already add nothing."""
    from mfgguf.train.experts.pieces import gathers_moments

    tc, R, todo = plan.tc, plan.rounds, plan.todo
    history = plan.steps * JSON_PER_STEP
    module = {r: _ffn(plan) + _shared(plan) + JSON_FIXED + history for r in range(1, R + 1)}
    gathers = gathers_moments(tc)  # the last round also gathers second moments (tailstats.py)
    ckpt = 3 * (_ffn(plan) + _shared(plan)) + history
    ckpt += 2 * _moments(plan) if gathers else 0
    experts = {i for i, _ in todo}
    inflight = 2 * min(workers, len(todo)) * ckpt  # a save writes the new checkpoint beside the old
    kept = len(experts - set(plan.checkpoints)) * ckpt if R > 1 else 0  # each expert's, between its rounds
    trunk = int(plan.trunk.bytes or 0)
    syncs = (R - plan.first_round + 1) if tc.shared != "none" and todo else 0
    rewrite = len(experts) * (_ffn(plan) + JSON_FIXED + history) if syncs else 0  # the final sync's FFN + means
    out = {
        "modules": sum(module[r] for _, r in todo) + rewrite,
        "checkpoints": kept + inflight,
        "moments": len(experts) * _moments_file(plan) if gathers else 0,
        "syncs": syncs * trunk,
        "other": (_moments(plan) + JSON_FIXED if todo else 0) + len(todo) * PLOT_AND_LOG,
    }
    end = out["modules"] + out["moments"] + out["syncs"] + out["other"] + inflight
    before_last = sum(module[r] for _, r in todo if r < R) + kept + inflight + max(0, syncs - 1) * trunk + out["other"]
    out["total"] = max(end, before_last)
    return out


def check_disk(run: Path, need: dict[str, int], keep_free: int) -> dict:
    """Refuse, in one line and before anything is written, a run whose estimate (`estimate`) does not fit in
    the free space of RUN's filesystem less `keep_free` bytes; else {need, free} for the run's record."""
    free = shutil.disk_usage(run).free
    if need["total"] + keep_free > free:
        parts = ", ".join(f"{k} {gb(v)}" for k, v in need.items() if k != "total" and v)
        keep = f" and --keep-free asks to leave {gb(keep_free)}" if keep_free else ""
        raise MfggufError(f"not enough disk for this run: it will hold up to {gb(need['total'])} at once ({parts}),"
                          f" {gb(free)} is"
                          f" free on {run}'s filesystem{keep}; free some space, put RUN on a larger disk, or train"
                          f" fewer experts now (--experts); nothing was trained")
    return {"need_bytes": need["total"], "free_bytes": free, "parts": {k: v for k, v in need.items() if k != "total"}}


def gb(n: float) -> str:
    """Bytes as a reader wants them: three digits and a decimal unit, as `df -H` prints them."""
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n:.0f} B"


__all__ = ["check_disk", "estimate", "gb"]
