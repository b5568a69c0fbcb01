"""The writer's workers: whole row chunks quantized and written on a pool of threads, and the progress bar.

Example:
    >>> pool = QuantPool(fd, threads=2)
    >>> pool.submit(x, "q8_0", offset, nbytes, release)  # x: (rows, cols) f32; release() once written
    >>> pool.drain(); pool.close()
"""

from __future__ import annotations

import collections
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from mfgguf.converters import quant as Q
from mfgguf.gguf.fileio import pwrite_all
from mfgguf.converters.profile import Profile


class QuantPool:
    """Quantize and write streamed row chunks on `threads` threads, one whole chunk per thread.

    Splitting one chunk over threads costs more than it gains for small tensors (a `1b` expert
    tensor in q8_0 ran about half as fast split over two threads: the hand-off dominates; docs/assembly.md), and most of a `1b` run's bytes are such tensors. So whole chunks go to
    different threads: each lands at its own offset, so their order does not matter, and the copy
    into the page cache overlaps the next chunk's quantization. A chunk's stream buffer is released
    once it is written; at most `4 x threads` chunks are in flight, and a worker's error is raised
    by the next `submit` or by `drain`.
    """

    def __init__(self, fd: int, threads: int, fast: bool = False, profile: Profile | None = None):
        self.fd, self.limit, self.fast = fd, 4 * threads, fast
        self.prof = profile if profile is not None else Profile()
        self.ex = ThreadPoolExecutor(threads, thread_name_prefix="mfgguf-quant")
        self.futs: collections.deque = collections.deque()

    def submit(self, x: np.ndarray, qtype: str, offset: int, nbytes: int, release=None) -> None:
        while self.futs and (len(self.futs) >= self.limit or self.futs[0].done()):
            self.futs.popleft().result()
        self.futs.append(self.ex.submit(self._job, x, qtype, offset, nbytes, release))

    def _job(self, x: np.ndarray, qtype: str, offset: int, nbytes: int, release) -> None:
        try:
            with self.prof.work("quantize"):
                q = Q.quantize(x, qtype, threads=1, fast=self.fast)
            assert q.nbytes == nbytes, (q.nbytes, nbytes)
            with self.prof.work("write"):
                pwrite_all(self.fd, q, offset)
        finally:
            if release is not None:
                release()

    def drain(self) -> None:
        while self.futs:
            self.futs.popleft().result()

    def close(self) -> None:
        """Let every queued chunk finish (each releases its stream buffer), whatever happened."""
        self.ex.shutdown(wait=True)


class Bar:
    """A rich progress bar over input bytes (MB/s, ETA), or nothing."""

    def __init__(self, total: int, enabled: bool):
        self.p = None
        if enabled:
            from rich.progress import (BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn,
                                       TransferSpeedColumn)

            self.p = Progress(TextColumn("assemble"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                              TimeRemainingColumn(), transient=False)
            self.p.start()
            self.task = self.p.add_task("assemble", total=total)

    def advance(self, n: int) -> None:
        if self.p is not None:
            self.p.advance(self.task, n)

    def close(self) -> None:
        if self.p is not None:
            self.p.stop()
            self.p = None
