"""What a training loop is told, grouped by what it is about: how a step computes (StepSetup), where and how its
state is saved and resumed (Checkpoints), and how the driver runs the schedule (Drive). The in-memory loop takes
all three (loop.run_loop); the layer-streamed one, which computes and checkpoints its own way, takes a Drive.

Example:
    >>> setup = StepSetup(dev=torch.device("cpu"), precision="fp32", route="anchor")
    >>> ckpt = Checkpoints(dir=Path("RUN/checkpoints/trunk"), meta={"module": "trunk"})
    >>> res = run_loop(model, named, data, tc, setup=setup, ckpt=ckpt, drive=Drive(stream=0, label="trunk"))
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch


@dataclass(frozen=True)
class StepSetup:
    """How the in-memory step computes: the same training whatever they are, in more or less time and memory."""

    dev: torch.device  # where the step runs (resolve_device)
    precision: str  # bf16 or fp32 (resolve_precision): bf16 is autocast over the forward and backward
    route: str  # the model's path through its FFNs: anchor (a trunk alone), single (trunk + one expert)
    recompute: bool = False  # keep block inputs only, recomputing activations in the backward: a big trunk fits
    micro: int | None = None  # sequences per forward/backward, the step accumulating the batch; None: the whole batch
    lr_scale: dict[str, float] | None = None  # {name: factor}: those parameters' LR is factor x the schedule's
    #                                           (make_optimizer's groups), e.g. an expert's shared copies


@dataclass(frozen=True)
class Checkpoints:
    """Where the in-memory loop keeps its state and what a state found there must match to be resumed."""

    dir: Path  # checkpoints are saved here, and resumed from here when one is there
    meta: dict  # saved in each checkpoint (config, trunk sha...); one found here must match it, else an error says
    #             how to start over
    keep: frozenset[str] = frozenset()  # parameters a resumed checkpoint must not overwrite (checkpoint.load): a
    #                                     round's shared copies start from the synced trunk, not the last round's
    resume_from: dict | None = None  # what a checkpoint found must match instead of `meta` (the previous round's)
    every_s: float | None = None  # also save once that long has passed since the last save: a whole model's state,
    #                               where a step count would save too often on a short run or too rarely on a long one
    branch_path: Path | None = None  # a wsd trunk: where the branch point is kept when the cooldown begins (branch.py)


@dataclass(frozen=True)
class Drive:
    """How the driver (driver.train_steps) runs the schedule over the data: in-memory and streamed alike."""

    stream: int  # which batch order: the batch at step s is drawn from (seed, stream, s), so each expert has its own
    label: str = "train"  # the progress bar's and the status file's name for this training
    progress: bool = True  # show a progress bar
    validation: Callable[[], dict] | None = None  # held-out {domain: loss}, recorded every tc.eval_every steps and
    #                                               after the schedule's last: the validation curve, kept in checkpoints
    until: int | None = None  # stop after that many of the schedule's steps (a sync round's end: the LR schedule
    #                           still spans the whole run), checkpointing there
    mask: np.ndarray | None = None  # the data's loss mask (data/masks.py: as long as the data, 0 on context tokens);
    #                                 None: every target counts
