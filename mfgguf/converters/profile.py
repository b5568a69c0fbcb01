"""Where assembly's time goes: seconds per phase, and per kind of work summed over the threads that do it.

Phases run one after the other (plan, header, preallocate, stream, merge, fold, router, fsync,
verify): their wall seconds add up to the whole. Inside the stream phase the work overlaps on
threads: reading (pread from the page cache or the disk), hashing (blake3/sha256), checking
(NaN/Inf), quantizing and writing (pwrite) each sum the seconds their threads spent on them, so
on 2 cores they can add up to twice the phase's wall time. `assemble` returns both (`phases_s`,
`work_s`), and scripts/bench/bench_assemble.py prints them in its JSON lines.

Example:
    >>> prof = Profile()
    >>> with prof.phase("stream"):
    ...     with prof.work("hash"):
    ...         h.update(buf)
    >>> prof.as_dict()
    {'phases_s': {'stream': 0.8}, 'work_s': {'hash': 0.3}}
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from contextlib import contextmanager


class Profile:
    def __init__(self):
        self.phases: dict[str, float] = {}
        self.works: defaultdict[str, float] = defaultdict(float)
        self._lock = threading.Lock()

    @contextmanager
    def phase(self, name: str):
        t = time.perf_counter()
        try:
            yield
        finally:
            self.phases[name] = self.phases.get(name, 0.0) + time.perf_counter() - t

    @contextmanager
    def work(self, name: str):
        t = time.perf_counter()
        try:
            yield
        finally:
            self.add(name, time.perf_counter() - t)

    def add(self, name: str, seconds: float) -> None:
        with self._lock:  # from reader and quantizer threads at once
            self.works[name] += seconds

    def as_dict(self) -> dict[str, dict[str, float]]:
        return {"phases_s": {k: round(v, 3) for k, v in self.phases.items()},
                "work_s": {k: round(v, 3) for k, v in sorted(self.works.items())}}
