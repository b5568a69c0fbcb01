"""One expert-training job of `train-experts`, as the scheduler and both backends see it.

schedule.py decides what runs and when; local.py (child processes) and ray.py (Ray
tasks) run jobs and fill in their state. Both read a job's status file and, when it fails, the
last line of its log.

Example:
    >>> Job(expert=3, round=1, log="RUN/logs/expert_003.log").row()["state"]
    'pending'
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path

from mfgguf.options import JobOptions
from mfgguf.run import RunDir, module_name


@dataclass
class Job:
    expert: int
    round: int
    state: str = "pending"  # pending | running | done | failed
    where: str = ""  # host (and pid, locally)
    wall_s: float = 0.0
    peak_rss_mb: float = 0.0
    retries: int = 0
    error: str = ""
    log: str = ""
    status: dict = field(default_factory=dict)  # the job's last status file (tokens/s, ETA)
    status_file: str = ""  # where the live view reads the status itself (a backend that cannot while the job runs)

    def row(self) -> dict:
        d = asdict(self)
        d.pop("status")
        d.pop("status_file")
        return d


def job_argv(rd: RunDir, i: int, opts: JobOptions) -> list[str]:
    """The `mfgguf train-expert` command line of one job (the local backend's child process)."""
    from mfgguf.stages import mfgguf_argv

    return mfgguf_argv("train-expert", rd.root, "--expert", i, *opts.argv(), "--no-progress")


def status_path(rd: RunDir, i: int) -> Path:
    """The status file a job of expert i rewrites as it trains (train/engine/status.py), for the live view."""
    return rd.root / "logs" / f"{module_name(i)}.status.json"


def last_error(log: Path) -> str:
    """The one-line error a failed job printed last (its log's last non-empty line)."""
    try:
        lines = [l.strip() for l in Path(log).read_text(errors="replace").splitlines() if l.strip()]
    except OSError:
        return "no log"
    return lines[-1].removeprefix("Error: ") if lines else "no output"
