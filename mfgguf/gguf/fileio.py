"""Positioned reads and writes of module files, GGUF outputs and other flat f32 files.

Every reader and writer of weights by offset (assembly, the merge, sync's outer step, the
streamed trunk's parameter store) goes through these few loops: `os.preadv`/`os.pwrite` may
move fewer bytes than asked, so each loops until the whole array is moved. The calls only some
systems have (preadv, posix_fadvise, posix_fallocate, fdatasync, sync_file_range: Linux has them
all) go through the helpers below, each with a portable fallback where the call is missing. Torch-free.

Example:
    >>> x = np.empty((rows, cols), np.float32)
    >>> pread_into(fd, x, offset, "module expert_001 (expert_001.safetensors) is truncated; retrain it")
    >>> pwrite_all(out_fd, x, offset)
"""

from __future__ import annotations

import ctypes
import errno
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
        n = read_at(fd, mv, offset)
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


def read_at(fd: int, mv: memoryview, offset: int) -> int:
    """Read into MV from fd at offset (preadv: no copy); a pread and a copy where the OS has no preadv."""
    if hasattr(os, "preadv"):
        return os.preadv(fd, [mv], offset)
    b = os.pread(fd, len(mv), offset)
    mv[:len(b)] = b
    return len(b)


def drop_cache(fd: int, offset: int = 0, nbytes: int = 0) -> None:
    """Drop the range's pages from the page cache (posix_fadvise DONTNEED; nbytes=0: to the end of the file).
    Nothing where the OS has no posix_fadvise: the pages then stay cached, which costs memory, not results."""
    if hasattr(os, "posix_fadvise"):
        os.posix_fadvise(fd, offset, nbytes, os.POSIX_FADV_DONTNEED)


def datasync(fd: int) -> None:
    """Make fd's written data durable: fdatasync, or fsync where the OS has no fdatasync."""
    (os.fdatasync if hasattr(os, "fdatasync") else os.fsync)(fd)


def allocate(fd: int, size: int) -> None:
    """Give fd's file SIZE bytes of disk now (posix_fallocate), so a full disk fails here, not an hour later.
    Where the OS or the filesystem cannot, the file is only grown to SIZE (sparse)."""
    if hasattr(os, "posix_fallocate"):
        try:
            os.posix_fallocate(fd, 0, size)
            return
        except OSError as e:
            if e.errno == errno.ENOSPC:
                raise MfggufError(f"not enough disk space for the output: it needs {size / 1e9:.2f} GB;"
                                  " free some space or write it elsewhere with -o") from None
            if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL):  # filesystems without fallocate: just grow
                raise
    os.ftruncate(fd, size)
