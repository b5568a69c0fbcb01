"""An expert job's training options as pieces: each brings its checks, trainable parameters, LR factors,
start state, JSON record and module tensors, and `train_expert` (expert.py) composes them in one order.

- the FFN: `PlainFfn` (route "single": trunk + anchor + this expert);
- `SharedCopies`: private f32 copies of trunk tensors (`--shared`, shared.py); none trains nothing;
- `BranchStart`: a fresh wsd expert of a wsd trunk continues from the trunk's branch point (branch.py);
- `RoundStart`: round r > 1 continues from round r - 1's checkpoint across a sync (rounds/);
- `statistics`: the router statistics from training's last steps (tailstats.py), or None for a pass
  after training (`--stats-from pass`).

Example:
    >>> ffn = PlainFfn()
    >>> named = {**ffn.params(model), **SharedCopies(cfg, tc).params(model)}
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn

from mfgguf.config import ModelConfig, TrainConfig
from mfgguf.errors import MfggufError
from mfgguf.model import Transformer
from mfgguf.run.records import ModuleMeta, RunInfo, module_name
from mfgguf.run import RunDir
from mfgguf.train.experts import shared as sh
from mfgguf.train.experts.stats import stats_tokens
from mfgguf.train.experts.tailstats import TailStats, tail_steps
from mfgguf.train.rounds.ends import round_end
from mfgguf.train.whole import branch as br


@dataclass
class Job:
    """What every piece sees: an expert job's inputs, fixed once its options and the trunk are read."""

    rd: RunDir
    i: int  # the expert, 1..N
    info: RunInfo
    trunk: ModuleMeta
    cfg: ModelConfig
    preset: str
    tc: TrainConfig
    rnd: int  # the round this job trains, 1..tc.rounds
    dev: torch.device
    prec: str
    data: np.ndarray  # the expert's shard
    extra: dict = field(default_factory=dict)  # what a piece measured while building, for the record

    @property
    def bf16_trunk(self) -> bool:
        return self.prec == "bf16"


def expert_params(model: Transformer) -> dict[str, nn.Parameter]:
    """The only trainable parameters: layers[*].experts[0]."""
    return {n: p for n, p in model.named_parameters() if ".experts.0." in n and p.requires_grad}


class PlainFfn:
    """The expert alone beside the anchor: what the assembled model computes for a token routed to it."""

    route, slot = "single", 0

    def params(self, model: Transformer) -> dict[str, nn.Parameter]:
        return expert_params(model)

    def tensors(self, model: Transformer) -> dict[str, torch.Tensor]:
        return model.expert_tensors(0)


@dataclass(frozen=True)
class SharedCopies:
    """`--shared`: the trunk tensors the expert also trains a private copy of (none: nothing)."""

    cfg: ModelConfig
    tc: TrainConfig

    @property
    def choice(self) -> str:
        return self.tc.shared

    def check(self) -> None:
        sh.check_shared(self.tc)

    def names(self) -> dict[str, str]:
        return sh.shared_names(self.cfg, self.choice)

    def params(self, model: Transformer) -> dict[str, nn.Parameter]:
        return sh.shared_params(model, self.choice)

    def lr_scales(self, model: Transformer) -> dict[str, float]:
        return sh.lr_scales(model, self.tc)

    def tensors(self, model: Transformer) -> dict[str, torch.Tensor]:
        return sh.shared_module_tensors(model, self.choice)

    def record(self) -> dict:
        """The module's record of its copies."""
        return sh.shared_meta(self.cfg, self.choice)


class BranchStart:
    """A fresh wsd expert of a wsd trunk starts from the trunk's branch point (a checkpoint supersedes it)."""

    @staticmethod
    def state(job: Job, named: dict, ffn: PlainFfn, ckpt_state: dict | None) -> dict | None:
        if job.rnd == 1 and ckpt_state is None and job.trunk.branch is not None and job.tc.schedule == "wsd":
            return br.start_from_branch(br.read_branch(job.rd, job.trunk), named,
                                        br.branch_names(job.cfg, job.tc))
        return None

    @staticmethod
    def record(job: Job) -> dict:
        return {"branch_start": br.branch_record(job.trunk, job.tc)}


class RoundStart:
    """Round r > 1 continues round r - 1's state, trained against the trunk before this sync: its FFN and
    AdamW moments, but the merged shared tensors just loaded from the new trunk (`keep`)."""

    @staticmethod
    def plan(job: Job, ckpt_meta: dict, ckpt_state: dict | None, ckpt_dir: Path, steps: int,
             shared: SharedCopies) -> tuple[dict | None, frozenset]:
        """(resume_from, keep) for run_loop: (None, empty) for round 1."""
        rnd, name = job.rnd, module_name(job.i)
        if rnd > 1 and ckpt_state and ckpt_state.get("trunk_sha256") == job.trunk.synced_from:
            if ckpt_state.get("step") != round_end(steps, job.tc.rounds, rnd - 1):
                raise MfggufError(f"{name}'s checkpoint in {ckpt_dir} stopped at step {ckpt_state.get('step')}, not"
                                  f" at the end of round {rnd - 1}; pass --restart to train it again from round 1")
            return {**ckpt_meta, "trunk_sha256": job.trunk.synced_from}, frozenset(shared.names())
        if rnd > 1 and not ckpt_state:
            raise MfggufError(f"{name} has no checkpoint of round {rnd - 1} in {ckpt_dir}, which round {rnd}"
                              f" continues from; retrain it from round 1 (a new RUN) or restore that directory")
        return None, frozenset()


def statistics(cfg: ModelConfig, tc: TrainConfig, steps: int) -> TailStats | None:
    """The router statistics of training's last steps (`--stats-from train`), else None (a pass after). They
    gather second moments too, which the pooled G takes instead of a pass (pooled.py; the final sync's
    adopt.py for an expert with shared copies and sync rounds), except for an expert with shared copies and
    one round: its copy trained the whole schedule apart from the others', where statistics from the copy
    routed far worse (docs/sync-rounds.md), so the final sync measures them again."""
    if tc.stats_from == "pass":
        return None
    first = steps - tail_steps(stats_tokens(asdict(tc)), tc.batch_size * cfg.ctx_len, steps)
    return TailStats(cfg.n_layers, cfg.dim, first, moments=gathers_moments(tc))


def gathers_moments(tc: TrainConfig) -> bool:
    """Whether an expert trained with `tc` writes the second moments of its last steps beside its module."""
    return tc.stats_from != "pass" and (tc.shared == "none" or tc.rounds > 1)


__all__ = ["Job", "expert_params", "PlainFfn", "SharedCopies", "BranchStart", "RoundStart", "statistics",
           "gathers_moments"]
