"""What `train-experts` shows while it runs: the whole run's progress and ETA, and the jobs running now.

The whole run is every selected expert's every round, jobs finished before this command included:
experts (jobs) done of all, tokens done of all, the run's speed and the time left. The speed is this
command's: the tokens its jobs trained (finished ones and those running, from their status files) over
its wall time so far, so each job's setup, scoring and statistics pass are in it and the ETA is the
wall clock's, not the training steps'. Tokens a killed run trained count as done but not as speed.

On a terminal a table of the running (and failed) jobs is redrawn under that line; in a log, the line
is printed when a job ends and now and then between. Cheap: a small JSON file per running job, read
twice a second at most.

Example:
    >>> view = LiveView(plan, jobs, enabled=True)   # a terminal: a live table; a log: lines
    >>> view.add(more_jobs); view.close()
"""

from __future__ import annotations

import sys
import threading
import time

from mfgguf.run import module_name
from mfgguf.train.engine.status import read_status
from mfgguf.train.fanout.jobs import Job
from mfgguf.train.fanout.plan import RunPlan

LINE_EVERY_S = 60.0  # a log's progress line between jobs' ends: often enough to see a run alive
TICK_S = 0.5  # how often the view reads the running jobs' status files


class RunProgress:
    """The whole run's counts from the plan and the jobs this command has started."""

    def __init__(self, plan: RunPlan, t0: float | None = None):
        self.plan, self.t0, self.jobs = plan, time.perf_counter() if t0 is None else t0, []

    def add(self, jobs: list[Job]) -> None:
        self.jobs += jobs

    def _done_steps(self, j: Job) -> int:
        """Job j's schedule steps done in its round (its status file's step, else its checkpoint's)."""
        a, b = self.plan.span(j.round)
        if j.state == "done":
            return b - a
        step = j.status.get("step") if j.status else None
        step = self.plan.at_step.get((j.expert, j.round), 0) if not isinstance(step, int) else step
        return min(max(step, a), b) - a

    def counts(self) -> dict:
        """Jobs and tokens done of the whole run, this command's tokens/s and the ETA in seconds (None: unknown)."""
        p = self.plan
        mine = {(j.expert, j.round) for j in self.jobs}
        left_before = sum(p.job_tokens(r) - p.resumed_tokens((i, r)) for i, r in p.todo if (i, r) not in mine)
        done_now = sum(self._done_steps(j) * p.per_step for j in self.jobs)
        fresh = sum(self._done_steps(j) * p.per_step - p.resumed_tokens((j.expert, j.round)) for j in self.jobs)
        tokens = p.total_tokens - left_before - sum(p.job_tokens(j.round) for j in self.jobs) + done_now
        wall = time.perf_counter() - self.t0
        tps = fresh / wall if fresh > 0 and wall > 0 else None
        jobs = p.total_jobs - len(p.todo) + sum(j.state == "done" for j in self.jobs)
        return {"jobs_done": jobs, "jobs": p.total_jobs, "tokens_done": tokens, "tokens": p.total_tokens,
                "tokens_per_s": tps, "eta_s": (p.total_tokens - tokens) / tps if tps else None, "wall_s": wall}

    def line(self) -> str:
        c, p = self.counts(), self.plan
        what = "experts" if p.rounds == 1 else f"jobs ({len(p.experts)} experts x {p.rounds} rounds)"
        speed = f"{c['tokens_per_s']:,.0f} tok/s" if c["tokens_per_s"] else "- tok/s"
        return (f"{c['jobs_done']}/{c['jobs']} {what} | {_si(c['tokens_done'])}/{_si(c['tokens'])} tokens"
                f" ({100 * c['tokens_done'] / max(c['tokens'], 1):.1f}%) | {speed} | ETA {_hms(c['eta_s'])}"
                f" | {_hms(c['wall_s'])} so far")


class LiveView:
    """The whole run's line and, on a terminal, a table of the jobs running now; refreshed by a thread of its own
    (the in-process backend trains in the caller's thread)."""

    def __init__(self, progress: RunProgress, enabled: bool):
        self.progress, self.lock, self.live = progress, threading.Lock(), None
        self.tty = enabled and sys.stderr.isatty()
        self.plain = enabled and not self.tty
        self.last_line, self.seen_done = time.monotonic(), 0
        self.stop = threading.Event()
        self.thread = None
        if self.tty:
            from rich.console import Console
            from rich.live import Live

            self.live = Live(self._table(), console=Console(stderr=True), refresh_per_second=2)
            self.live.start()
        if enabled:
            self.thread = threading.Thread(target=self._tick, name="train-experts view", daemon=True)
            self.thread.start()

    def refresh(self) -> None:
        with self.lock:
            for j in self.progress.jobs:
                if j.state == "running" and j.status_file:
                    j.status = read_status(j.status_file) or j.status
            if self.live is not None:
                self.live.update(self._table())
            elif self.plain:
                done = sum(j.state in ("done", "failed") for j in self.progress.jobs)
                if done != self.seen_done or time.monotonic() - self.last_line > LINE_EVERY_S:
                    self.seen_done, self.last_line = done, time.monotonic()
                    print(f"train-experts: {self.progress.line()}", file=sys.stderr, flush=True)

    def close(self) -> None:
        self.stop.set()
        if self.thread is not None:
            self.thread.join()
            self.thread = None
        self.refresh()
        if self.live is not None:
            self.live.stop()
            self.live = None

    def _tick(self) -> None:
        while not self.stop.wait(TICK_S):
            self.refresh()

    def _table(self):
        from rich.table import Table

        t = Table(title=f"train-experts: {self.progress.line()}", title_justify="left")
        for c in ("expert", "round", "state", "where", "step", "tok/s", "ETA", "loss", "retries"):
            t.add_column(c, justify="left" if c in ("expert", "state", "where") else "right")
        for j in self.progress.jobs:
            if j.state not in ("running", "failed") and not j.retries:  # 100 jobs: the ones that need an eye
                continue
            s = j.status
            eta = s.get("eta_s")
            t.add_row(module_name(j.expert), str(j.round), j.state, j.where,
                      f"{s.get('step', '')}/{s.get('steps', '')}" if s else "",
                      f"{s['tokens_per_s']:,.0f}" if s.get("tokens_per_s") else "",
                      f"{eta:.0f}s" if isinstance(eta, (int, float)) and j.state == "running" else "",
                      f"{s['loss']:.3f}" if isinstance(s.get("loss"), (int, float)) else "", str(j.retries))
        return t


def print_summary(jobs: list[Job], summary: dict) -> None:
    """The table that ends a run: every job's wall time, peak RSS and retries, under the run's totals."""
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"train-experts: {len(jobs)} job(s) on {summary['backend']}, {summary['syncs']} sync(s),"
                    f" {summary['wall_s']:.1f} s", title_justify="left")
    for c in ("expert", "round", "state", "where", "wall s", "peak RSS MB", "retries"):
        t.add_column(c, justify="left" if c in ("expert", "state", "where") else "right")
    for j in jobs:
        t.add_row(module_name(j.expert), str(j.round), j.state if not j.error else f"failed: {j.error}", j.where,
                  f"{j.wall_s:.1f}", f"{j.peak_rss_mb:.0f}", str(j.retries))
    Console(stderr=True).print(t)


def _si(n: float) -> str:
    """A token count for a line: 950, 12.3k, 4.56M, 1.20B."""
    for unit, scale in (("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.3g}{unit}" if n / scale < 100 else f"{n / scale:.0f}{unit}"
    return f"{n:.0f}"


def _hms(s: float | None) -> str:
    """Seconds for a line: seconds, minutes and seconds, or hours and minutes; '-' when unknown."""
    if s is None:
        return "-"
    s = int(round(s))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m {s % 60:02d}s"
    return f"{s // 3600}h {s % 3600 // 60:02d}m"


__all__ = ["LiveView", "RunProgress", "print_summary"]
