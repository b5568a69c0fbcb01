"""The local backend of `train-experts`: one `mfgguf train-expert` process per job, `workers` at once.

Each child gets `threads` torch threads (OMP_NUM_THREADS), a log file and a status file; its peak
RSS is its own (`os.wait4`). A child killed by a signal (OOM killer, a user's kill) is started
again, up to `retries` times, and resumes from its checkpoint; a child that exits 1 failed for a
reason it printed, which becomes the job's error, and the other jobs go on.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from pathlib import Path

from mfgguf.options import JobOptions
from mfgguf.run import RunDir
from mfgguf.train.fanout.jobs import Job, job_argv, last_error, status_path
from mfgguf.train.engine.status import ENV as STATUS_ENV
from mfgguf.train.engine.status import read_status

POLL_S = 0.5


class LocalBackend:
    own_progress = False  # the scheduler's table shows the jobs' status files

    def __init__(self, rd: RunDir, workers: int, threads: int, retries: int = 2):
        self.rd, self.workers, self.threads, self.retries = rd, workers, threads, retries
        self.procs: dict[int, tuple[subprocess.Popen, Job, float]] = {}  # pid -> (process, job, start time)

    def describe(self) -> str:
        return f"{self.workers} local process(es) x {self.threads} thread(s)"

    def run(self, jobs: list[Job], opts: JobOptions, view) -> None:
        queue = list(jobs)
        try:
            while queue or self.procs:
                while queue and len(self.procs) < self.workers:
                    self._start(queue.pop(0), opts)
                self._reap(queue)
                for _, job, _ in self.procs.values():
                    job.status = read_status(self._status_path(job))
                view.refresh()
                time.sleep(POLL_S)
        finally:
            view.close()

    def close(self) -> None:
        for proc, _, _ in self.procs.values():  # interrupted: the children resume from checkpoints next time
            proc.send_signal(signal.SIGTERM)
        for proc, _, _ in self.procs.values():
            proc.wait()
        self.procs.clear()

    def _status_path(self, job: Job) -> Path:
        return status_path(self.rd, job.expert)

    def _start(self, job: Job, opts: JobOptions) -> None:
        (self.rd.root / "logs").mkdir(exist_ok=True)
        self._status_path(job).unlink(missing_ok=True)
        env = {**os.environ, "OMP_NUM_THREADS": str(self.threads), "MKL_NUM_THREADS": str(self.threads),
               STATUS_ENV: str(self._status_path(job))}
        with open(job.log, "ab") as log:
            proc = subprocess.Popen(job_argv(self.rd, job.expert, opts), stdout=log, stderr=subprocess.STDOUT, env=env)
        job.state, job.where = "running", f"{socket.gethostname()} pid {proc.pid}"
        self.procs[proc.pid] = (proc, job, time.perf_counter())

    def _reap(self, queue: list[Job]) -> None:
        for pid in list(self.procs):
            got, status, usage = os.wait4(pid, os.WNOHANG)
            if got == 0:
                continue
            proc, job, t0 = self.procs.pop(pid)
            proc.returncode = rc = os.waitstatus_to_exitcode(status)
            job.wall_s += time.perf_counter() - t0
            job.peak_rss_mb = max(job.peak_rss_mb, usage.ru_maxrss / 1024)
            job.status = read_status(self._status_path(job)) or job.status
            if rc == 0:
                job.state = "done"
            elif rc < 0 and job.retries < self.retries:  # killed from outside: resume from the checkpoint
                job.retries += 1
                job.state = "pending"
                queue.insert(0, job)
            else:
                job.state = "failed"
                job.error = (f"killed by signal {-rc} ({signal.Signals(-rc).name}; out of memory?)" if rc < 0
                             else last_error(Path(job.log)))


__all__ = ["LocalBackend"]
