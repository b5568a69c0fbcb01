"""Read module files once each, hashing them on background threads, and yield their tensors in row chunks.

Hashing every input byte is the assembly's integrity guarantee and was its costliest step with
sha256. Modules record a blake3 digest too (several times faster per core: docs/assembly.md), and
that is what is checked. Each file is read by a "lane" thread: it preads the file sequentially into
its own small pool of buffers, hashes each buffer and checks it for NaN/Inf (both drop the GIL), and
queues it. The caller
consumes row chunks from up to `lanes` files at once, one chunk from each in turn, while later
chunks are still being read and checked: hashing of several files and quantization run side by
side on every core. Every yielded chunk is a view of bytes that were hashed, so the hash covers
exactly what is written; the digest is compared with the module's record as soon as the file ends.

Order: modules enter in index order, and one round takes one chunk from each active module in
index order. Experts have the same tensors in the same file order, so for any tensor region an
earlier expert's chunk is always yielded before a later one's: anything accumulated across
experts (the router's pooled second moment) sees the same sequence of additions as a one-file-
at-a-time read. Errors too are raised in module order: a damaged module raises only after every
earlier module has been read and checked.

Memory: lanes x LANE_BUFFERS buffers of chunk_bytes, whatever the number of modules.

Example:
    >>> for pos, name, r0, x, release in stream_modules([trunk, e1, e2]):  # x: (rows, cols) f32 view
    ...     use(x)
    ...     release()  # the buffer goes back to its reader
"""

from __future__ import annotations

import functools
import os
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator

import numpy as np
from blake3 import blake3

from mfgguf.errors import MfggufError
from mfgguf.gguf.fileio import pread_into, truncated
from mfgguf.modules.module import Module
from mfgguf.converters.profile import Profile

CHUNK_BYTES = 4 << 20  # f32 bytes per chunk: read, hashed, quantized and written per step
LANE_BUFFERS = 4  # read-ahead per file, in chunks


@dataclass
class _Done:
    digest: str


@dataclass(eq=False)
class _Job:
    pos: int  # position of the module in the caller's list
    mod: Module
    pool: "queue.SimpleQueue[np.ndarray]"
    prof: Profile
    out: "queue.SimpleQueue" = field(default_factory=queue.SimpleQueue)
    cancel: bool = False
    done: bool = False  # the lane put its last item (a _Done or an exception)


def stream_modules(mods: list[Module], *, lanes: int = 2, chunk_bytes: int = CHUNK_BYTES,
                   on_bytes: Callable[[int], None] | None = None, profile: Profile | None = None) -> Iterator[tuple]:
    """Yield (module position, tensor name, first row, (rows, cols) f32 chunk, release) for every tensor of `mods`.

    Each file is read once, sequentially; every byte is hashed and the digest compared with the
    module's recorded blake3 when the file ends; every chunk is
    checked for NaN/Inf before it is yielded.
    A chunk is a view into a reused buffer, the consumer's until it calls `release()` (from any
    thread; exactly once): a chunk can be quantized and written while the next ones stream. The
    lane that read it reads no further than its few buffers allow, so release them promptly.
    `profile` sums the lanes' seconds of reading, hashing and checking (profile.py).
    """
    prof = profile if profile is not None else Profile()
    lanes = max(1, min(lanes, len(mods)))
    pools, work, threads = _start_lanes(mods, lanes, chunk_bytes)

    active: list[tuple[int, _Job]] = []  # (lane, job), in module order
    nxt = 0
    failed: dict[int, BaseException] = {}  # module position -> its first error

    def start(lane: int) -> None:
        nonlocal nxt
        if nxt < len(mods) and (not failed or nxt < min(failed)):
            job = _Job(nxt, mods[nxt], pools[lane], prof)
            work[lane].put(job)
            active.append((lane, job))
            nxt += 1

    def drain(job: _Job) -> None:
        """Stop job's lane and give its buffers back; returns when the lane has let go of the file."""
        job.cancel = True
        while not job.done:
            _take(job)

    def fail(job: _Job, e: BaseException) -> None:
        failed[job.pos] = e
        for lane_job in [a for a in active if a[1].pos >= job.pos]:
            drain(lane_job[1])
            active.remove(lane_job)

    try:
        for lane in range(lanes):
            start(lane)
        while active:
            for lane, job in list(active):
                if (lane, job) not in active:  # removed by a failure earlier in this round
                    continue
                item = _take(job)
                if isinstance(item, _Done):
                    active.remove((lane, job))
                    if (e := _mismatch(job.mod, item.digest)) is not None:
                        fail(job, e)
                    else:
                        start(lane)
                    continue
                if isinstance(item, BaseException):
                    active.remove((lane, job))
                    fail(job, item)
                    continue
                name, r0, x, buf, finite = item
                if not finite:
                    job.pool.put(buf)
                    fail(job, MfggufError(f"module {job.mod.name}: tensor {name} contains NaN or Inf; retrain it"))
                    continue
                if on_bytes is not None:
                    on_bytes(x.nbytes)
                yield job.pos, name, r0, x, functools.partial(job.pool.put, buf)
        if failed:
            raise failed[min(failed)]
    finally:
        for _, job in active:
            drain(job)
        for q in work:
            q.put(None)
        for t in threads:
            t.join()


def _start_lanes(mods: list[Module], lanes: int, chunk_bytes: int):
    """Each lane's pool of buffers, its work queue and its reading thread, started."""
    cols_max = max((_cols(e) for m in mods for e in m.entries.values()), default=1)
    n_elem = max(chunk_bytes // 4, cols_max)
    pools = []
    for _ in range(lanes):
        pool: queue.SimpleQueue[np.ndarray] = queue.SimpleQueue()
        for _ in range(LANE_BUFFERS):
            pool.put(np.empty(n_elem, np.float32))
        pools.append(pool)
    work: list[queue.SimpleQueue] = [queue.SimpleQueue() for _ in range(lanes)]
    threads = [threading.Thread(target=_lane, args=(q,), name=f"mfgguf-read-{i}", daemon=True) for i, q in enumerate(work)]
    for t in threads:
        t.start()
    return pools, work, threads


def _mismatch(m: Module, digest) -> MfggufError | None:
    """The error where a module's streamed digest is not the one recorded for it."""
    if digest == m.meta.blake3:
        return None
    return MfggufError(f"module {m.name} ({m.path.name}) does not match its recorded blake3:"
                       " the file changed after training; retrain it")


def _take(job: _Job):
    item = job.out.get()
    if isinstance(item, (_Done, BaseException)):
        job.done = True
    elif job.cancel:  # drained: the buffer goes straight back
        job.pool.put(item[3])
    return item


def _finite(x: np.ndarray) -> bool:
    """No NaN/Inf: a finite f32 sum says so at memory speed; one that overflowed falls back to the exact test."""
    return bool(np.isfinite(np.add.reduce(x, axis=None)) or np.isfinite(x).all())


def _cols(e) -> int:
    return e.shape[-1] if e.shape else 1


def _lane(work: queue.SimpleQueue) -> None:
    """Thread: read + hash one file at a time, handing row chunks to the consumer through job.out."""
    while (job := work.get()) is not None:
        try:
            _read_file(job)
        except OSError as e:  # the file went away or became unreadable after the plan checked it
            m = job.mod
            job.out.put(MfggufError(f"module {m.name} ({m.path.name}) cannot be read ({e.strerror}); retrain it"))
        except BaseException as e:  # noqa: BLE001 - handed to the consumer, raised there in module order
            job.out.put(e)


def _read_file(job: _Job) -> None:
    mod, prof = job.mod, job.prof
    h = blake3()
    fd = os.open(mod.path, os.O_RDONLY)
    try:
        pos = 0
        for e in sorted(mod.entries.values(), key=lambda e: e.begin):
            if e.begin > pos:  # the header, and any padding between tensors
                h.update(_pread(fd, e.begin - pos, pos, mod))
            cols = _cols(e)
            rows = (e.end - e.begin) // 4 // cols if cols else 0  # an empty anchor's (dim, 0) down: no rows to hand on
            r0 = 0
            while r0 < rows:
                buf = job.pool.get()
                if job.cancel:  # the consumer stopped: let go of the file
                    job.pool.put(buf)
                    job.out.put(_Done(""))
                    return
                n = min(max(1, len(buf) // cols), rows - r0)
                x = buf[: n * cols]
                t0 = time.perf_counter()
                pread_into(fd, x, e.begin + r0 * cols * 4, truncated(mod))
                t1 = time.perf_counter()
                h.update(x.view(np.uint8))
                t2 = time.perf_counter()
                finite = _finite(x)
                t3 = time.perf_counter()
                prof.add("read", t1 - t0), prof.add("hash", t2 - t1), prof.add("check", t3 - t2)
                job.out.put((e.name, r0, x.reshape(n, cols), buf, finite))
                r0 += n
            pos = e.end
        while tail := os.pread(fd, 1 << 20, pos):  # bytes past the last tensor are part of the file too
            h.update(tail)
            pos += len(tail)
    finally:
        os.close(fd)
    job.out.put(_Done(h.hexdigest()))


def _pread(fd: int, n: int, offset: int, mod: Module) -> bytes:
    b = os.pread(fd, n, offset)
    while len(b) < n:
        more = os.pread(fd, n - len(b), offset + len(b))
        if not more:
            raise MfggufError(truncated(mod))
        b += more
    return b
