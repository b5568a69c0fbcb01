"""Small file helpers every stage writes through: atomic replacement, digests, JSON.

Readers see a file's old content or its new content, never half of it: a killed stage leaves its
outputs as they were. No pickle anywhere: safetensors, numpy .npy (allow_pickle=False) and JSON only.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path

from mfgguf.errors import MfggufError


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    return file_digests(path, chunk)["sha256"]


def file_digests(path: Path, chunk: int = 1 << 22) -> dict[str, str]:
    """{"sha256": ..., "blake3": ...} of a file, in one read.

    sha256 names a module (experts record their trunk's); blake3 is what assembly checks every
    byte against, because it is several times faster per core than sha256 (and releases the GIL):
    the integrity check no longer dominates an assembly.
    """
    from blake3 import blake3

    h, b3 = hashlib.sha256(), blake3()
    with open(path, "rb") as f:
        while b := f.read(chunk):
            h.update(b)
            b3.update(b)
    return {"sha256": h.hexdigest(), "blake3": b3.hexdigest()}


def blake3_file(path: Path) -> str:
    """The file's blake3 alone, read through mmap on every core (`file_digests` reads it once for both digests)."""
    from blake3 import blake3

    return blake3(max_threads=blake3.AUTO).update_mmap(str(path)).hexdigest()


@contextmanager
def atomic_path(dest: Path, suffix: str = ""):
    """Yield a temporary path beside `dest`; on success fsync and rename it over `dest`.

    On any error the temporary file is removed and `dest` is untouched.
    """
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{dest.name}.", suffix=suffix + ".tmp", dir=dest.parent)
    os.close(fd)
    tmp = Path(tmp)
    try:
        yield tmp
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, dest)
    except Exception as e:
        if _disk_full(e):  # a long training's last write: one line, and the same command resumes it
            raise MfggufError(f"the disk is full: {dest} could not be written and is as it was; free some space"
                              " and run the same command again") from None
        raise
    finally:
        tmp.unlink(missing_ok=True)


def _disk_full(e: BaseException) -> bool:
    # safetensors' writer raises its own error type, carrying the OS error only in its message
    return (isinstance(e, OSError) and e.errno == errno.ENOSPC) or "No space left on device" in str(e)


def swap_dir_into_place(tmp: Path, out: Path) -> None:
    """Rename the finished directory `tmp` to `out`; an old `out` is moved aside first (and put back if
    the rename fails), then removed: `out` is always either the old directory or the new one."""
    old = None
    if out.exists():
        old = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".old", dir=out.parent))
        os.rmdir(old)
        os.replace(out, old)
    try:
        os.replace(tmp, out)
    except BaseException:
        if old is not None:
            os.replace(old, out)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def link_or_copy(src: Path, dst: Path) -> None:
    """A hard link of `src` at `dst` (free, and immune to `src` being replaced later), else a copy."""
    try:
        os.link(src, dst)
    except OSError:  # another filesystem, or one without hard links
        shutil.copy2(src, dst)


def write_text(path: Path, text: str) -> None:
    """Replace `path` with `text` atomically: readers see the old file or the new one, never half."""
    with atomic_path(path) as tmp:
        tmp.write_text(text)


def write_json(path: Path, obj) -> None:
    write_text(path, json.dumps(obj, indent=2, sort_keys=False) + "\n")


def read_json(path: Path, what: str) -> dict:
    try:
        return json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise MfggufError(f"{what} is missing: {path}") from None
    except (OSError, ValueError) as e:
        raise MfggufError(f"{what} is unreadable: {path} ({e})") from None


__all__ = ["sha256_file", "file_digests", "atomic_path", "swap_dir_into_place", "link_or_copy", "write_text",
           "write_json", "read_json"]
