"""Parameters and AdamW moments of a model that does not fit in RAM, in files on disk.

The trunk is cut into units: the token embedding, each block, and the head (output norm +
output projection). A unit has one file per state set, `{unit}.{a|b}.bin`, holding three regions
of f32 -- parameters | exp_avg | exp_avg_sq -- each the unit's tensors back to back in model order,
and one scratch file `{unit}.grad.bin` for the current step's gradients.

Every step is a checkpoint, at no extra I/O (ping-pong): a step reads set `cur` and writes the
updated parameters and moments to the other set; only once every unit is written and synced does
`state.json` (replaced atomically) name the new set. A kill at any moment leaves the last finished
step intact.

Page cache: pages are dropped after use (posix_fadvise DONTNEED; writes are flushed first with
sync_file_range), so a streamed run's memory is what it computes with, and every step really
reads from disk, as on a machine whose RAM cannot cache the files. Where the OS has neither call
(macOS), the pages stay cached: the same results, with more memory in use.

Example:
    >>> store = ParamStore(Path("RUN/checkpoints/trunk/stream"), trunk_units(cfg))
    >>> store.create(init_tensor)            # set "a": initial weights, zero moments
    >>> w = store.read("blk.0", "a", "P")    # (numel,) f32: block 0's parameters
"""

from __future__ import annotations

import json
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from mfgguf.config import ModelConfig
from mfgguf.gguf.fileio import SYNC_FILE_RANGE_ALL, datasync, drop_cache, pread_into, pwrite_all, sync_range
from mfgguf.errors import MfggufError
from mfgguf.run import atomic_path

STATE_FORMAT = "mfgguf-streamed-checkpoint"
STATE_VERSION = 1
REGIONS = ("P", "M", "V")  # parameters, exp_avg, exp_avg_sq
_F32 = 4
_MAX_WRITES = 3  # writes in flight before the producer waits: bounds the memory they hold


@dataclass(frozen=True)
class Slot:
    """One tensor of a unit: its torch name, shape and offset (f32 elements) inside each region."""

    name: str
    shape: tuple[int, ...]
    offset: int

    @property
    def numel(self) -> int:
        return int(np.prod(self.shape))

    @property
    def row(self) -> int:  # elements per row (a vector is one row)
        return self.numel // self.shape[0] if len(self.shape) > 1 else self.numel

    @property
    def rows(self) -> int:
        return self.shape[0] if len(self.shape) > 1 else 1


@dataclass(frozen=True)
class Unit:
    name: str  # "embd", "blk.{l}" or "head"
    slots: tuple[Slot, ...]

    @property
    def numel(self) -> int:  # elements of one region
        return sum(s.numel for s in self.slots)

    def slot(self, name: str) -> Slot:
        return next(s for s in self.slots if s.name == name)


def trunk_units(cfg: ModelConfig) -> list[Unit]:
    """The trunk's trainable tensors (as `trunk_model` builds them) grouped into streamed units."""
    from mfgguf.model import trunk_model

    with torch.device("meta"):  # names and shapes without allocating a byte
        model, _ = trunk_model(cfg)
    groups: dict[str, list[tuple[str, tuple]]] = {}
    for n, p in model.named_parameters():
        if not p.requires_grad:
            continue  # the router row of the seed's slot: never trained
        u = "embd" if n.startswith("tok_embd.") else "head" if n.startswith("output") else "blk." + n.split(".")[1]
        groups.setdefault(u, []).append((n, tuple(p.shape)))
    units = []
    for u, items in groups.items():
        off, slots = 0, []
        for n, shape in items:
            slots.append(Slot(n, shape, off))
            off += int(np.prod(shape))
        units.append(Unit(u, tuple(slots)))
    return units


def _pread(fd: int, out: np.ndarray, offset: int) -> np.ndarray:
    return pread_into(fd, out, offset, lambda at: f"streamed state file ended early (fd {fd}, offset {at}); pass --restart")


def _pwrite(fd: int, arr: np.ndarray, offset: int, drop: bool) -> None:
    n = pwrite_all(fd, arr, offset)
    # not glibc/Linux: no sync_file_range, fdatasync at commit does the flushing
    if drop and sync_range(fd, offset, n, SYNC_FILE_RANGE_ALL):  # the pages are clean after it
        drop_cache(fd, offset, n)


class ParamStore:
    """The units' files under `root`, read and written by offset, with a reader and a writer thread.

    `drop_cache` (default True) evicts every range from the page cache after it is read or
    written. Counters `bytes_read` / `bytes_written` say what a step cost in I/O.
    """

    def __init__(self, root: Path, units: list[Unit], drop_cache: bool = True):
        self.root, self.units, self.drop = Path(root), {u.name: u for u in units}, drop_cache
        self._fds: dict[str, int] = {}
        self._reader = ThreadPoolExecutor(1, thread_name_prefix="mfgguf-read")
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="mfgguf-write")
        self._slots = threading.BoundedSemaphore(_MAX_WRITES)  # writes in flight (any thread may queue them)
        self._error: BaseException | None = None
        self._dirty: set[str] = set()
        self.bytes_read = self.bytes_written = 0

    # ---- files ----------------------------------------------------------------------------------

    def _path(self, unit: str, kind: str) -> Path:  # kind: "a", "b" or "grad"
        return self.root / f"{unit}.{kind}.bin"

    def _fd(self, unit: str, kind: str) -> int:
        key = f"{unit}.{kind}"
        if key not in self._fds:  # scratch files ("acts") are created on first use
            self._fds[key] = os.open(self._path(unit, kind), os.O_RDWR | (os.O_CREAT if unit == "acts" else 0), 0o644)
        return self._fds[key]

    def _offset(self, unit: str, region: str, slot: Slot | None, row0: int) -> int:
        u = self.units[unit]
        base = (REGIONS.index(region) * u.numel if region in REGIONS else 0)
        if slot is not None:
            base += slot.offset + row0 * slot.row
        return base * _F32

    def disk_bytes(self) -> int:
        """Bytes on disk: two state sets (3 regions each) and one gradient file per unit."""
        return sum(7 * u.numel * _F32 for u in self.units.values())

    def create(self, init) -> None:
        """Set "a": parameters from `init(slot) -> tensor` (called in model order), zero moments."""
        self.root.mkdir(parents=True, exist_ok=True)
        for u in self.units.values():
            for kind, regions in (("a", 3), ("b", 3), ("grad", 1)):
                with open(self._path(u.name, kind), "wb") as f:
                    f.truncate(regions * u.numel * _F32)  # sparse zeros: the moments' initial value
            for s in u.slots:
                self.write(u.name, "a", "P", init(s).detach().float().contiguous().numpy().reshape(-1), s)
        self.flush()

    # ---- reads ----------------------------------------------------------------------------------

    def read(self, unit: str, kind: str, region: str, slot: Slot | None = None, row0: int = 0,
             rows: int | None = None) -> np.ndarray:
        """f32 elements of a region: the whole region, one slot, or rows [row0, row0 + rows) of it."""
        u = self.units[unit]
        n = u.numel if slot is None else (slot.numel if rows is None else rows * slot.row)
        out = np.empty(n, dtype=np.float32)
        fd, off = self._fd(unit, kind), self._offset(unit, region, slot, row0)
        _pread(fd, out, off)
        if self.drop:
            drop_cache(fd, off, n * _F32)
        self.bytes_read += n * _F32
        return out

    def read_rows(self, unit: str, kind: str, slot: Slot, ids: np.ndarray) -> np.ndarray:
        """(len(ids), row) parameter rows `ids` (sorted, unique) of a matrix slot: the embedding gather."""
        out = np.empty((len(ids), slot.row), dtype=np.float32)
        fd = self._fd(unit, kind)
        for i, r in enumerate(ids):
            _pread(fd, out[i], self._offset(unit, "P", slot, int(r)))
        if self.drop:
            drop_cache(fd, 0, 0)
        self.bytes_read += out.nbytes
        return out

    def read_scratch(self, n: int, offset: int) -> np.ndarray:
        """`n` f32 of the activations scratch file (`acts.tmp.bin`) at element `offset`."""
        out, fd = np.empty(n, dtype=np.float32), self._fd("acts", "tmp")
        _pread(fd, out, offset * _F32)
        if self.drop:
            drop_cache(fd, offset * _F32, n * _F32)
        self.bytes_read += out.nbytes
        return out

    def write_scratch(self, arr: np.ndarray, offset: int) -> None:
        """Queue `arr` (f32) for the activations scratch file at element `offset` (never synced: a
        step's scratch is worthless after a crash)."""
        self._queue(self._fd("acts", "tmp"), arr, offset * _F32)

    def prefetch(self, *args, **kw) -> Future:
        """`read(...)` on the reader thread, while the caller computes."""
        return self._reader.submit(self.read, *args, **kw)

    def submit(self, fn, *args) -> Future:
        """Any reading function on the reader thread (reads stay in the order they were asked)."""
        return self._reader.submit(fn, *args)

    # ---- writes ---------------------------------------------------------------------------------

    def write(self, unit: str, kind: str, region: str, arr: np.ndarray, slot: Slot | None = None,
              row0: int = 0) -> None:
        """Queue `arr` (f32) for writing at that place; at most _MAX_WRITES in flight."""
        fd, off = self._fd(unit, kind), self._offset(unit, region, slot, row0)
        self._dirty.add(f"{unit}.{kind}")
        self._queue(fd, arr, off)

    def _queue(self, fd: int, arr: np.ndarray, off: int) -> None:
        self._slots.acquire()
        fut = self._writer.submit(_pwrite, fd, arr, off, self.drop)
        fut.add_done_callback(self._written)
        self.bytes_written += arr.nbytes

    def _written(self, fut: Future) -> None:
        if fut.exception() is not None:
            self._error = fut.exception()
        self._slots.release()

    def after_writes(self, fn) -> Future:
        """Run `fn` on the writer thread once every write queued so far is on disk (FIFO)."""
        return self._writer.submit(fn)

    def flush_writes(self) -> None:
        """Wait for every queued write (without syncing to disk); raise the first write error."""
        self.after_writes(lambda: None).result()
        if self._error is not None:
            raise self._error

    def flush(self) -> None:
        """Wait for every queued write and make the written files durable."""
        self.flush_writes()
        for key in sorted(self._dirty):
            fd = self._fds[key]
            datasync(fd)
            if self.drop:
                drop_cache(fd, 0, 0)
        self._dirty.clear()

    # ---- the step pointer -------------------------------------------------------------------------

    def commit(self, state: dict) -> None:
        """Flush, then atomically replace state.json: from now on `state["set"]` is the current set."""
        self.flush()
        with atomic_path(self.root / "state.json") as tmp:
            tmp.write_text(json.dumps({"format": STATE_FORMAT, "version": STATE_VERSION, **state}))

    def state(self) -> dict | None:
        return load_state(self.root)

    def close(self) -> None:
        self.flush()
        self._reader.shutdown()
        self._writer.shutdown()
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()


def load_state(root: Path) -> dict | None:
    """The committed JSON state of a streamed checkpoint in `root`, or None when there is none."""
    p = Path(root) / "state.json"
    if not p.is_file():
        return None
    try:
        s = json.loads(p.read_text())
    except (OSError, ValueError):
        s = {}
    if s.get("format") != STATE_FORMAT or s.get("version") != STATE_VERSION:
        raise MfggufError(f"streamed checkpoint {p} is unreadable or from another mfgguf;"
                          " pass --restart (restart=True) to delete it and start over")
    return s
