"""Run a pipeline stage as its own process and measure it: wall time and the child's peak RSS.

The demo and the evaluation run every heavy stage this way. Each expert trains in its own
process, as the design says, and each stage's peak RSS is its own: `os.wait4` returns the
resource usage of that one child, not the maximum over all children so far. (Linux folds the
parent's RSS at spawn into the child's peak, so a light parent, as ours are, is the floor.)

Example:
    >>> r = run_stage("trunk", ["train-trunk", "RUN", "--preset", "tiny"])
    >>> r.wall_s, r.peak_rss_mb
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass

from mfgguf.errors import MfggufError


@dataclass
class StageResult:
    stage: str
    wall_s: float
    peak_rss_mb: float
    skipped: bool = False  # finished in an earlier run (resumed)
    train_s: float | None = None  # of wall_s, the training steps (the rest: start-up, scoring, statistics, saving)

    def to_dict(self) -> dict:
        return asdict(self)


def mfgguf_argv(*args: str) -> list[str]:
    """The command line that runs `mfgguf ARGS` with this interpreter."""
    return [sys.executable, "-m", "mfgguf", *map(str, args)]


def run_stage(stage: str, args: list[str], *, capture: bool = False, env: dict | None = None) -> tuple[StageResult, str]:
    """Run `mfgguf ARGS` (or a full argv if args[0] is this interpreter) and wait for it.

    The child shares the terminal, so its progress bars stay live; with `capture` its stdout
    is returned instead. A failing stage has already printed its one-line error; this raises
    MfggufError naming the stage so the caller stops there.
    """
    argv = args if args and args[0] == sys.executable else mfgguf_argv(*args)
    t0 = time.perf_counter()
    with tempfile.TemporaryFile("w+") as out:
        proc = subprocess.Popen(argv, stdout=out if capture else None, env={**os.environ, **(env or {})})
        try:
            _, status, usage = os.wait4(proc.pid, 0)  # this child's own rusage, not all children's
        except KeyboardInterrupt:
            proc.wait()
            raise
        proc.returncode = rc = os.waitstatus_to_exitcode(status)
        out.seek(0)
        text = out.read() if capture else ""
    wall = time.perf_counter() - t0
    if rc != 0:
        raise MfggufError(f"stage {stage!r} failed with exit code {rc} (its message is above); fix that and re-run to resume")
    return StageResult(stage, round(wall, 2), round(usage.ru_maxrss / 1024, 1)), text
