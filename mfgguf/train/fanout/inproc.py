"""The one-machine backend of `train-experts`: every job in this process, one after another.

On one machine the jobs run in turn anyway (one job uses every core well on the presets that matter),
so a child process per job only adds its start: the interpreter, torch's import, the trunk's checks.
Here each job is the same `train_expert` call a child would make (same seed, same thread count, so the
same bytes), its checkpoint written as a child writes it, so a killed `train-experts` resumes from the
job it was in. A job that fails for a reason (`MfggufError`) fails alone, as a child's exit 1 does; any
other exception stops the run with its traceback, as a bug should.

The peak RSS a job reports is the process's own high-water mark so far (jobs share the process), so
the largest job's is the run's peak.
"""

from __future__ import annotations

import ctypes
import gc
import os
import resource
import socket
import time

from mfgguf.errors import MfggufError
from mfgguf.options import JobOptions
from mfgguf.run import RunDir
from mfgguf.train.fanout.jobs import Job, status_path
from mfgguf.train.engine.status import ENV as STATUS_ENV


class InProcessBackend:
    own_progress = False  # the scheduler's view shows the whole run, reading each job's status file from a thread

    def __init__(self, rd: RunDir, threads: int):
        self.rd, self.threads = rd, threads

    def describe(self) -> str:
        return f"this process x {self.threads} thread(s)"

    def run(self, jobs: list[Job], opts: JobOptions, view) -> None:
        import torch

        from mfgguf.train.experts.expert import train_expert

        before = torch.get_num_threads()
        torch.set_num_threads(self.threads)  # what a child gets through OMP_NUM_THREADS: the same reductions
        (self.rd.root / "logs").mkdir(exist_ok=True)
        try:
            for job in jobs:
                status = status_path(self.rd, job.expert)
                status.unlink(missing_ok=True)
                job.state, job.where = "running", f"{socket.gethostname()} pid {os.getpid()}"
                job.status_file = str(status)
                os.environ[STATUS_ENV] = str(status)
                t0 = time.perf_counter()
                try:
                    train_expert(self.rd.root, job.expert, options=opts.train, device=opts.device,
                                 precision=opts.precision, progress=False)
                    job.state = "done"
                except MfggufError as e:
                    job.state, job.error = "failed", str(e)
                finally:
                    os.environ.pop(STATUS_ENV, None)
                    job.wall_s += time.perf_counter() - t0
                    job.peak_rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
                    _release()
        finally:
            torch.set_num_threads(before)
            view.close()

    def close(self) -> None:
        pass


def _release() -> None:
    """Give the last job's freed buffers back to the system, so the next job starts from the same RSS."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: the allocator keeps them, which costs memory, not results
        pass


__all__ = ["InProcessBackend"]
