"""Positioned reads and writes of module files, GGUF outputs and other flat f32 files.

Every reader and writer of weights by offset (assembly, the merge, sync's outer step, the
streamed trunk's parameter store) goes through these few loops: `os.preadv`/`os.pwrite` may
move fewer bytes than asked, so each loops until the whole array is moved. Torch-free.

Example:
    >>> x = np.empty((rows, cols), np.float32)
    >>> pread_into(fd, x, offset, "module expert_001 (expert_001.safetensors) is truncated; retrain it")
    >>> pwrite_all(out_fd, x, offset)
"""

from __future__ import annotations

import ctypes
import os
from typing import Callable

import numpy as np

from mfgguf.errors import MfggufError

SYNC_FILE_RANGE_WRITE = 2  # start writing dirty pages, do not wait
SYNC_FILE_RANGE_ALL = 7  # WAIT_BEFORE | WRITE | WAIT_AFTER: the range is clean when it returns


def pread_into(fd: int, x: np.ndarray, offset: int, ended: str | Callable[[int], str]) -> np.ndarray:
    """Fill all of `x`'s bytes from `fd` at `offset`; returns `x`.

    Where the file ends first, raise MfggufError(`ended`), or `ended(offset where it ended)`.
    """
    if not x.size:  # nothing to read (an empty anchor); memoryview cannot cast a view with a zero in its shape
        return x
    mv = memoryview(x).cast("B")
    while len(mv):
        n = os.preadv(fd, [mv], offset)
        if not n:
            raise MfggufError(ended(offset) if callable(ended) else ended)
        mv, offset = mv[n:], offset + n
    return x


def pwrite_all(fd: int, x: np.ndarray, offset: int) -> int:
    """Write all of `x`'s bytes (made contiguous) to `fd` at `offset`; returns the byte count."""
    mv = memoryview(np.ascontiguousarray(x)).cast("B")
    total = len(mv)
    while len(mv):
        n = os.pwrite(fd, mv, offset)
        mv, offset = mv[n:], offset + n
    return total


def truncated(mod) -> str:
    """The error for module file `mod` (layout.Module) ending before its header says it does."""
    return f"module {mod.name} ({mod.path.name}) is truncated; retrain it"


_SYNC_RANGE: list = []  # [sync_file_range as a ctypes function, or None], loaded on first use


def sync_range(fd: int, offset: int, nbytes: int, flags: int) -> bool:
    """Linux sync_file_range(fd, offset, nbytes, flags); False where libc lacks it (nothing was done).
    nbytes=0 means to the end of the file. Durability still comes from fsync."""
    if not _SYNC_RANGE:
        try:
            f = ctypes.CDLL(None, use_errno=True).sync_file_range
            f.argtypes, f.restype = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint], ctypes.c_int
            _SYNC_RANGE.append(f)
        except (OSError, AttributeError):
            _SYNC_RANGE.append(None)
    if _SYNC_RANGE[0] is None:
        return False
    _SYNC_RANGE[0](fd, offset, nbytes, flags)  # on failure fsync still does all the work
    return True
