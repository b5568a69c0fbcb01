"""`mfgguf train-experts`: every expert job of a RUN, many at once, locally or on a Ray cluster.

A job is exactly `mfgguf train-expert RUN --expert I` (same function, same seed, same bytes); the
scheduler only decides where and when it runs:
  - local:  one process per job, as many at once as cores and memory allow (`plan_workers`:
            the measured peak RSS of one job of the preset, JOB_MB, against available memory, and
            the threads a job of the preset uses well, JOB_THREADS), each with cores // workers threads;
            where that is one job at a time, the jobs run in this process instead (inproc.py);
  - ray:    one Ray task per job with its CPUs and memory declared (ray.py), so no node
            takes more than fits; the engine retries a task whose worker died.
With sync rounds (`--rounds R`, experts with `--shared`), it runs every expert's round, then
`mfgguf sync`, then the next round. Re-running picks up only what is missing: an expert whose
module is already trained against the current trunk (and round) is skipped, and a killed job
resumes from its checkpoint. A job that fails for a real reason (its one-line error is kept) does
not stop the others; the command then exits 1 naming it, before any sync.

Each job writes a log (RUN/logs/expert_XXX.log) and a status file the live view reads (which
expert, where, tokens/s, ETA); a summary table (wall time, peak RSS, retries) ends the run and is
saved as RUN/logs/train-experts.json.

Example:
    >>> train_experts(Path("RUN"), experts=[1, 2, 3, 4], workers=2, job=JobOptions(TrainOptions(tokens=20_000)))
    {'jobs': [...], 'failed': [], 'rounds': 1, ...}
"""

from __future__ import annotations

import os
import time
from dataclasses import replace
from pathlib import Path

from mfgguf.config import DEFAULT_PRESET
from mfgguf.errors import MfggufError
from mfgguf.machine import count_startup, mem_available
from mfgguf.options import JobOptions, parse_experts
from mfgguf.run import (ModuleMeta, RunDir, module_name, read_module, recorded_experts, router_stats_current,
                   write_json)
from mfgguf.train.fanout.disk import check_disk, estimate, gb
from mfgguf.train.fanout.jobs import Job
from mfgguf.train.fanout.plan import check_shards, run_plan
from mfgguf.train.fanout.view import LiveView, RunProgress, print_summary

# Peak RSS of one expert job by preset (MB), measured on the 2-core test machine (bf16 autocast),
# rounded up: tiny 501-543 (tests/train/fanout/test_schedule.py's summaries), small 1,314 with --shared all
# (the demo), 1b 1,366 FFN-only / under 2,048 with --shared attn (scripts/bench/bench_train.py). The local
# scheduler's per-job memory reservation and the `memory` each Ray task declares; unknown presets
# use the largest.
JOB_MB = {"tiny": 560, "small": 1350, "1b": 2048}
# Torch threads one job should get before another job runs beside it (scripts/bench/bench_fanout.py on 2 cores:
# tiny runs faster as 2 jobs x 1 thread than as 1 job x 2 threads, small slower, so small keeps 2;
# docs/distributed.md).
JOB_THREADS = {"tiny": 1, "small": 2, "1b": 2}
MEMORY_HEADROOM = 0.85  # share of available memory the local scheduler may fill with jobs
KEEP_FREE = 10**9  # bytes a run leaves free on RUN's filesystem beyond its own estimate (the system needs room too)




def plan_workers(preset: str, workers: int | None = None) -> tuple[int, int]:
    """(jobs at once, torch threads per job) for the local scheduler on this machine.

    OMP_NUM_THREADS, when set, caps the cores it spreads jobs over: the caller's limit holds for the
    jobs it starts too (a study sharing the machine with another keeps to its share).
    """
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    cap = os.environ.get("OMP_NUM_THREADS", "")
    cores = min(cores, int(cap)) if cap.isdigit() and int(cap) > 0 else cores
    if workers is None:
        avail_mb = mem_available(fallback=8 << 30) / (1 << 20)  # unknown: assume a small laptop's 8 GiB
        fit = int(avail_mb * MEMORY_HEADROOM // JOB_MB.get(preset, max(JOB_MB.values())))
        workers = max(1, min(cores // JOB_THREADS.get(preset, 2), fit))
    if workers < 1:
        raise MfggufError(f"--workers must be at least 1, got {workers}")
    return workers, max(1, cores // workers)


def train_experts(run: Path, *, experts: str | list[int] | None = None, workers: int | None = None,
                  ray: str | None = None, transfer: str = "auto", retries: int = 2, progress: bool = True,
                  job: JobOptions = JobOptions(), in_process: bool | None = None, keep_free: int = KEEP_FREE) -> dict:
    """Train every selected expert not yet trained, many at once: local processes, or Ray tasks.

    `experts` selects (`1-40,45`; default all). Locally, `workers` jobs run at once (default: as
    many as cores and memory allow). `ray` is a Ray address (`auto` joins the cluster `ray start`
    made, `local` starts one on this machine): one task per expert; `transfer` says how workers get
    the trunk, shard and tokenizer: `shared` (RUN is on a filesystem every node sees), `copy` (sent
    through Ray's object store, module files sent back) or `auto` (shared where the worker sees RUN).
    With `rounds` R > 1 every round of every expert runs, with `mfgguf sync` after each. `job`
    holds the training options (tokens, shared, lr, ...), device and precision of `train-expert`,
    the same for every job. A job
    killed from outside is retried up to `retries` times (it resumes from its checkpoint); one that
    fails with an error is reported and the others go on. Exits 1 (MfggufError) if any job failed.
    `in_process` runs the local jobs in this process, one after another: no process start per job, and
    the compiled step (`--compile`) is compiled once for every job instead of once a job (a job killed
    from outside then stops the run; re-running resumes it; the process keeps some of each job's memory, so
    its peak is above a child's). The default (None) does so where the jobs run one at a time anyway (one
    worker); False starts a child process per job (docs/benchmarks.md, the recipe's wall).
    Before anything trains it counts the disk the jobs left will write (module files, checkpoints at their
    peak, private trunk copies, syncs' trunks, router statistics) and refuses in one line where that and
    `keep_free` bytes do not fit in the free space of RUN's filesystem, or where an expert left to train has a
    shard shorter than one context. While it runs it shows the whole
    run: experts done of all, tokens done of all, tokens/s and the ETA.

    Example:
        mfgguf train-experts RUN --workers 2 --shared all --rounds 4
    """
    job.train.check("expert", "train-experts")
    rd = RunDir(run)
    n = rd.run_info().n_experts
    trunk = _trunk_meta(rd)
    ids = parse_experts(experts, n) if not isinstance(experts, list) else experts
    ids = list(dict.fromkeys(ids))  # each expert once
    rounds = int(job.train.rounds or _rounds_in_run(rd, ids) or 1)
    opts = replace(job, train=replace(job.train, rounds=rounds))
    _drop_finished_checkpoints(rd, ids, trunk)
    plan = run_plan(rd, ids, trunk, rounds, opts, [i for i in ids if _trained(rd, i, trunk, trunk.syncs + 1)])
    check_shards(rd, plan)
    n_workers, threads = plan_workers(trunk.preset or DEFAULT_PRESET, workers) if ray is None else (len(ids), 1)
    need = estimate(plan, n_workers)
    disk = check_disk(rd.root, need, keep_free)
    if plan.todo:
        _say(progress, f"{len(plan.todo)} of {plan.total_jobs} job(s) to run, {plan.total_tokens - plan.done_tokens:,}"
                       f" tokens; disk: up to {gb(need['total'])} of {gb(disk['free_bytes'])} free")
    backend = _backend(rd, trunk, ray, (n_workers, threads), in_process, transfer, retries)
    t0 = time.perf_counter()
    run_progress = RunProgress(plan, t0)
    try:
        all_jobs, syncs = _run_rounds(rd, ids, n, rounds, backend, opts, progress, run_progress)
        if not any(j.state == "failed" for j in all_jobs) and _all_finished(rd, n) \
                and not router_stats_current(rd):
            from mfgguf.train.experts.pooled import pool_router_stats

            _say(progress, "router statistics: trunk + each expert over its shard (pooled.py)")
            pool_router_stats(rd.root, progress=progress)
    finally:
        backend.close()
    summary = {"run": str(rd.root), "backend": backend.describe(), "rounds": rounds, "syncs": syncs,
               "wall_s": round(time.perf_counter() - t0, 2), "jobs": [j.row() for j in all_jobs],
               "failed": [j.expert for j in all_jobs if j.state == "failed"], "disk": disk,
               "progress": {k: v for k, v in run_progress.counts().items() if k != "eta_s"}}
    (rd.root / "logs").mkdir(exist_ok=True)
    write_json(rd.root / "logs" / "train-experts.json", summary)
    if progress:
        print_summary(all_jobs, summary)
    if summary["failed"]:
        first = next(j for j in all_jobs if j.state == "failed")
        raise MfggufError(f"{len(summary['failed'])} expert job(s) failed, e.g. {module_name(first.expert)}: {first.error}"
                          f" (log: {first.log}); fix it and re-run train-experts to train only what is missing")
    return summary


def _backend(rd: RunDir, trunk: ModuleMeta, ray: str | None, plan: tuple[int, int], in_process: bool | None, transfer: str,
             retries: int):
    """The backend that runs the jobs: this process, local child processes (`plan`: jobs at once, threads
    each), or Ray tasks."""
    n_workers, threads = plan
    if ray is None:
        if in_process or (in_process is None and n_workers == 1):
            from mfgguf.train.fanout.inproc import InProcessBackend

            return InProcessBackend(rd, n_workers * threads)
        from mfgguf.train.fanout.local import LocalBackend

        count_startup(False)  # the job processes count their own starts; a sync here must not claim this one's
        return LocalBackend(rd, n_workers, threads, retries=retries)
    count_startup(False)  # as for local job processes: Ray's workers run the jobs
    from mfgguf.train.fanout.ray import RayBackend

    return RayBackend(rd, ray, JOB_MB.get(trunk.preset or DEFAULT_PRESET, max(JOB_MB.values())), transfer=transfer,
                      retries=retries)


def _run_rounds(rd: RunDir, ids: list[int], n_experts: int, rounds: int, backend, opts: JobOptions, progress: bool,
                run_progress: RunProgress) -> tuple[list[Job], int]:
    """Each round's jobs of the experts not trained yet, then its sync, until the last round (or a failure,
    or a selection that leaves other experts to train first); every job run, and the syncs."""
    all_jobs: list[Job] = []
    syncs = 0
    while True:
        if rd.pending_sync() is not None:  # a sync that was killed: finish it first
            from mfgguf.train.rounds.sync import sync

            sync(rd.root, progress=progress)
        trunk = _trunk_meta(rd)
        if trunk.final:
            break
        r = trunk.syncs + 1
        jobs = [Job(i, r, log=str(rd.root / "logs" / f"{module_name(i)}.log")) for i in ids
                if not _trained(rd, i, trunk, r)]
        if jobs:
            _say(progress, f"round {r}/{rounds}: {len(jobs)} expert job(s) on {backend.describe()}")
            run_progress.add(jobs)
            backend.run(jobs, opts, LiveView(run_progress, progress and not backend.own_progress))
            all_jobs += jobs
        failed = [j for j in jobs if j.state == "failed"]
        if failed:
            break
        if not _needs_sync(rd, ids):
            break
        from mfgguf.train.rounds.sync import sync

        if len(ids) < n_experts and sorted(ids) != recorded_experts(trunk):
            _say(progress, f"round {r}: the {len(ids)} selected experts are trained; train the others, then"
                           f" `mfgguf sync {rd.root}`, or merge these alone: `mfgguf sync {rd.root} --experts"
                           f" {','.join(map(str, ids))}`")
            break
        _say(progress, f"sync {r}/{rounds}")
        sync(rd.root, progress=progress)
        syncs += 1
        if r >= rounds:
            break
    return all_jobs, syncs


# ---- what is done ------------------------------------------------------------------------------


def _trunk_meta(rd: RunDir) -> ModuleMeta:
    if not rd.module_meta(0).is_file():
        raise MfggufError(f"{rd.root} has no trained trunk; run `mfgguf train-trunk {rd.root}` first")
    return read_module(rd, 0)


def _trained(rd: RunDir, i: int, trunk: ModuleMeta, r: int) -> bool:
    """Expert i has finished round r against the current trunk."""
    if not rd.module_meta(i).is_file():
        return False
    m = read_module(rd, i)
    return m.trunk_sha256 == trunk.sha256 and m.round == r


def _all_finished(rd: RunDir, n: int) -> bool:
    """Every expert of the run has finished its last round against the current trunk (nothing left to sync)."""
    trunk = _trunk_meta(rd)
    for i in range(1, n + 1):
        if not rd.module_meta(i).is_file():
            return False
        if not read_module(rd, i).finished_against(trunk.sha256):
            return False
    return True


def _drop_finished_checkpoints(rd: RunDir, ids: list[int], trunk: ModuleMeta) -> None:
    """A kill between a job's module file and its checkpoint's removal leaves the checkpoint of an expert that has
    finished: nothing would resume it, and at a large shape it holds more than the module."""
    from mfgguf.train.engine import checkpoint as ckpt_io

    for i in ids:
        d = rd.checkpoint_dir(i)
        if d.is_dir() and rd.module_meta(i).is_file() and read_module(rd, i).finished_against(trunk.sha256):
            ckpt_io.remove(d)


def _rounds_in_run(rd: RunDir, ids: list[int]) -> int | None:
    """The --rounds the run's experts were started with, so a re-run need not repeat it."""
    for i in ids:
        if rd.module_meta(i).is_file():
            return read_module(rd, i).rounds
    return None


def _needs_sync(rd: RunDir, ids: list[int]) -> bool:
    """A sync follows a round when the experts trained shared copies (R = 1 too: the final sync)."""
    metas = [read_module(rd, i) for i in ids if rd.module_meta(i).is_file()]
    return any(m.shared_tensors for m in metas) and not any(m.shared_merged for m in metas)


def _say(progress: bool, msg: str) -> None:
    if progress:
        from rich.console import Console

        Console(stderr=True).print(f"[bold cyan]train-experts[/] {msg}", highlight=False, soft_wrap=True)


__all__ = ["JOB_MB", "plan_workers", "train_experts"]
