"""DiLoCo's outer optimizer for `mfgguf sync`: Nesterov momentum on each round's pseudo-gradient.

Plain sync makes the merge m of the experts' copies the next trunk. With `--outer-lr η
--outer-momentum μ` (Douillard et al. 2023, "DiLoCo") the merge only defines the round's
pseudo-gradient Δ = t - m (t: the trunk the round started from), and the next trunk is

    v' = μ v + Δ              v: the momentum after the previous sync (0 before the first)
    t' = t - η (Δ + μ v')     Nesterov's look-ahead form, as DiLoCo's outer SGD

η = 1, μ = 0 is plain sync (t' = m; that path does not run this code, so its bits are unchanged).
DiLoCo's choice is η = 0.7, μ = 0.9: at the first sync that moves the trunk η (1 + μ) times the way to the
merge, later ones also along the previous rounds' direction.

The momentum v (f32, only the merged tensors, in trunk order) is a safetensors file written beside
the new trunk under rounds/sync_<k>/after/ and published with it as RUN/rounds/outer.safetensors.
Its metadata names the trunk its round started from (`from_trunk`); the next sync only uses it
when that is the current trunk's `synced_from`, so a stale momentum is refused, never applied.
Memory: one row chunk of a tensor, like the merge.

Example:
    >>> t2, v2 = outer_rows(t, m, v, lr=0.7, momentum=0.9)  # (rows, cols) f32 each
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

from mfgguf.gguf.fileio import pread_into, pwrite_all
from mfgguf.errors import MfggufError

OUTER_FORMAT = "mfgguf-outer-momentum"
OUTER_FILE = "outer.safetensors"
DILOCO_LR, DILOCO_MOMENTUM = 0.7, 0.9  # the paper's outer Nesterov settings


def check_outer(lr: float, momentum: float) -> None:
    """Raise a one-line error for settings outside the optimizer's range."""
    if not 0 < lr <= 4:
        raise MfggufError(f"--outer-lr {lr} is out of range; use a step in (0, 4], e.g. 1 (plain merge) or 0.7 (DiLoCo)")
    if not 0 <= momentum < 1:
        raise MfggufError(f"--outer-momentum {momentum} is out of range; use a value in [0, 1), e.g. 0 or 0.9 (DiLoCo)")


def is_plain(lr: float, momentum: float) -> bool:
    """η = 1, μ = 0: the next trunk is the merge itself."""
    return lr == 1 and momentum == 0


def outer_rows(t: np.ndarray, m: np.ndarray, v: np.ndarray | None, *, lr: float,
               momentum: float) -> tuple[np.ndarray, np.ndarray]:
    """(t', v') for trunk rows t, merged rows m and momentum v (None: zero); f64 inside, f32 out."""
    t64 = t.astype(np.float64)
    d = t64 - m  # (rows, cols): the round's pseudo-gradient
    v2 = d if v is None else momentum * v.astype(np.float64) + d
    t2 = t64 - lr * (d + momentum * v2)
    return t2.astype(np.float32), v2.astype(np.float32)


class MomentumFile:
    """One momentum file: its header's offsets, read or written one row chunk at a time with pread/pwrite."""

    def __init__(self, path: Path, offsets: dict[str, int], meta: dict, fd: int):
        self.path, self.offsets, self.meta, self.fd = path, offsets, meta, fd

    @classmethod
    def create(cls, path: Path, shapes: dict[str, tuple[int, ...]], meta: dict) -> "MomentumFile":
        """A zero-filled f32 file holding `shapes` (in the order given), opened for writing."""
        header, off, offsets = {"__metadata__": {k: str(v) for k, v in {"format": OUTER_FORMAT, **meta}.items()}}, 0, {}
        for name, shape in shapes.items():
            n = 4 * int(np.prod(shape))
            header[name] = {"dtype": "F32", "shape": list(shape), "data_offsets": [off, off + n]}
            offsets[name], off = off, off + n
        head = json.dumps(header, separators=(",", ":")).encode()
        head += b" " * (-len(head) % 8)
        base = 8 + len(head)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        os.write(fd, len(head).to_bytes(8, "little") + head)
        os.ftruncate(fd, base + off)
        return cls(path, {k: base + o for k, o in offsets.items()}, meta, fd)

    @classmethod
    def open(cls, path: Path) -> "MomentumFile":
        fd = os.open(path, os.O_RDONLY)
        try:
            n = int.from_bytes(os.pread(fd, 8, 0), "little")
            header = json.loads(os.pread(fd, n, 8))
        except (OSError, ValueError) as e:
            os.close(fd)
            raise MfggufError(f"the outer momentum {path} is unreadable ({e}); rerun the round, or sync with"
                              " --outer-momentum 0") from None
        meta = header.pop("__metadata__", {})
        if meta.get("format") != OUTER_FORMAT:
            os.close(fd)
            raise MfggufError(f"{path} is not an mfgguf outer momentum file; remove it or sync with --outer-momentum 0")
        return cls(path, {k: 8 + n + e["data_offsets"][0] for k, e in header.items()}, meta, fd)

    def read(self, name: str, r0: int, rows: int, cols: int) -> np.ndarray | None:
        """Rows r0..r0+rows of `name` ((rows, cols) f32), None when the file does not hold it."""
        if name not in self.offsets:
            return None
        x = np.empty((rows, cols), np.float32)
        return pread_into(self.fd, x, self.offsets[name] + r0 * cols * 4,
                          f"the outer momentum {self.path} is truncated; rerun the round")

    def write(self, name: str, r0: int, rows: np.ndarray) -> None:
        pwrite_all(self.fd, np.ascontiguousarray(rows, np.float32), self.offsets[name] + r0 * rows.shape[-1] * 4)

    def close(self, sync: bool = False) -> None:
        if sync:
            os.fsync(self.fd)
        os.close(self.fd)


def previous_momentum(rounds_dir: Path, trunk_meta: dict) -> MomentumFile | None:
    """The momentum left by the sync that made the current trunk, or None (first sync, or it used μ = 0).

    A file whose `from_trunk` is not the current trunk's `synced_from` belongs to another history:
    refused with a one-line error rather than applied.
    """
    used = (trunk_meta.get("sync") or {}).get("outer_momentum", 0)
    if not used:
        return None
    path = rounds_dir / OUTER_FILE
    if not path.is_file():
        raise MfggufError(f"the last sync kept an outer momentum but {path} is missing; restore it, or sync with"
                          " --outer-momentum 0 to start the momentum over")
    f = MomentumFile.open(path)
    if f.meta.get("from_trunk") != trunk_meta.get("synced_from"):
        f.close()
        raise MfggufError(f"{path} belongs to another sync history than the current trunk; remove it, or sync with"
                          " --outer-momentum 0 to start the momentum over")
    return f
