"""What a `train-experts` command has left to do, counted before anything trains.

Its jobs (expert, round) in the order they run, the tokens each trains, and how far each already is
(the checkpoint a killed run left behind). The whole run's progress line (view.py) and the disk check
(disk.py) read it. Every job of a run trains the same schedule: one TrainConfig over the trunk's preset,
the schedule's steps cut into `rounds` equal parts.

Example:
    >>> plan = run_plan(RunDir("RUN"), [1, 2, 3], trunk_meta, 1, JobOptions(TrainOptions(tokens=20_480)), trained=[1])
    >>> plan.todo, plan.total_tokens
    (((2, 1), (3, 1)), 61440)
"""

from __future__ import annotations

from dataclasses import dataclass, field

from mfgguf.config import ModelConfig, TrainConfig
from mfgguf.errors import MfggufError
from mfgguf.options import JobOptions
from mfgguf.run import ModuleMeta, RunDir
from mfgguf.train.experts.config import expert_config


@dataclass(frozen=True)
class RunPlan:
    experts: tuple[int, ...]  # the selected experts
    rounds: int  # R: every expert trains R rounds, a sync after each (1: no rounds)
    first_round: int  # the round this command starts in (the trunk's syncs so far + 1)
    steps: int  # optimizer steps of one expert's whole schedule (every round together)
    per_step: int  # tokens per optimizer step
    todo: tuple[tuple[int, int], ...]  # the (expert, round) jobs left, in the order they run
    cfg: ModelConfig  # the trunk's shape, which every expert shares
    tc: TrainConfig  # every job's training options over the trunk's preset
    trunk: ModuleMeta = field(repr=False)  # the trunk's record (its tensors' shapes: disk.py)
    at_step: dict = field(default_factory=dict)  # (expert, round) -> schedule step its checkpoint holds
    checkpoints: tuple[int, ...] = ()  # experts with a checkpoint on disk now (a killed job's, or between rounds)

    def span(self, r: int) -> tuple[int, int]:
        """Round r's schedule steps [first, end)."""
        from mfgguf.train.rounds.ends import round_end

        return (round_end(self.steps, self.rounds, r - 1) if r > 1 else 0), round_end(self.steps, self.rounds, r)

    def job_tokens(self, r: int) -> int:
        """The tokens one job of round r trains."""
        a, b = self.span(r)
        return (b - a) * self.per_step

    def resumed_tokens(self, job: tuple[int, int]) -> int:
        """The tokens of `job` its checkpoint already holds (0: none, or one from before its round)."""
        a, b = self.span(job[1])
        return (min(max(self.at_step.get(job, 0), a), b) - a) * self.per_step

    @property
    def total_jobs(self) -> int:
        return len(self.experts) * self.rounds

    @property
    def total_tokens(self) -> int:
        """The whole run's training tokens: every selected expert's schedule, done or not."""
        return len(self.experts) * self.steps * self.per_step

    @property
    def done_tokens(self) -> int:
        """The tokens trained before this command: jobs finished, and what their checkpoints hold of the others."""
        return self.total_tokens - sum(self.job_tokens(r) - self.resumed_tokens((i, r)) for i, r in self.todo)


def run_plan(rd: RunDir, ids: list[int], trunk: ModuleMeta, rounds: int, opts: JobOptions, trained: list[int]) -> RunPlan:
    """The jobs left of `ids` over `rounds` rounds, `trained` being the experts that finished the current round."""
    from mfgguf.train.engine import checkpoint as ckpt_io
    from mfgguf.train.engine.driver import schedule_steps

    ec = expert_config(trunk, opts.train)
    cfg, tc = ec.cfg, ec.tc
    first = trunk.syncs + 1
    todo = () if trunk.final else (
        tuple((i, first) for i in ids if i not in trained)
        + tuple((i, r) for r in range(first + 1, rounds + 1) for i in ids))
    at_step, held = {}, []
    for i, r in todo:
        if r == first:  # a killed job's checkpoint (or the previous round's, which its span clamps away)
            state = ckpt_io.peek(rd.checkpoint_dir(i))
            at_step[(i, r)] = int(state.get("step", 0)) if state else 0
            held += [i] if state else []
    return RunPlan(experts=tuple(ids), rounds=rounds, first_round=first, steps=schedule_steps(tc, cfg.ctx_len),
                   per_step=tc.batch_size * cfg.ctx_len, todo=todo, cfg=cfg, tc=tc, trunk=trunk, at_step=at_step,
                   checkpoints=tuple(held))


def check_shards(rd: RunDir, plan: RunPlan) -> None:
    """Refuse, before anything trains, a run with an expert left to train whose shard holds less than one context:
    its job would fail only when its turn came, after the others' hours (a cluster partition of many experts over
    little text makes such shards)."""
    import numpy as np

    need = plan.cfg.ctx_len + 1
    short = {i: len(np.load(rd.shard(i), mmap_mode="r")) for i in sorted({i for i, _ in plan.todo})}
    short = {i: n for i, n in short.items() if n < need}
    if short:
        which = ", ".join(f"{i} ({n} tokens)" for i, n in list(short.items())[:6]) + (", ..." if len(short) > 6 else "")
        raise MfggufError(f"expert shard(s) {which} hold less than one context of {need} tokens; nothing was trained:"
                          " prepare again with fewer experts or more text (--max-chars-per-domain), or leave them out"
                          " with --experts")


__all__ = ["RunPlan", "check_shards", "run_plan"]
