"""The router's statistics inside the GGUF: key-values that let `mfgguf extend` recompute the router later.

llama.cpp refuses a file with tensors its architecture does not name, so the statistics travel as
key-values under `mfgguf.router.` (schema.py declares the keys): per expert slot its FFN-input
means (layers, dim) and token count, per source (one RUN's pooled statistics) its second moment G
(layers, dim, dim) and token count, and which source each expert came with. Every front-end skips
keys it does not know. Float blocks are base64 of little-endian f32 bytes, one string item per
block, so any parser reads one block in one piece and the values round-trip bit for bit.

The writer knows the sizes when it plans the header and the values only after the modules have
streamed: the plan holds `schema.Hole`s of the exact length (`kv_entries`), the header is written
around them (layout.write_header), and `write_blob` fills them in place with os.pwrite,
base64-encoding a few MB at a time. No placeholder string is ever built.

Example:
    >>> kv = kv_entries(n_layers=2, dim=64, counts=[10, 12], sources=["ab.."], source_counts=[22], ridge=True)
    >>> write_blob(fd, offset, means_of_expert_0)  # offset: where the hole's bytes start
    >>> read_blob(fd, offset, length, (2, 64))
"""

from __future__ import annotations

import base64
import os

import numpy as np

from . import schema
from .fileio import pwrite_all

PIECE = 3 << 20  # raw bytes encoded at a time: a multiple of 3, so the pieces' base64 concatenates exactly


def b64_len(nbytes: int) -> int:
    return 4 * ((nbytes + 2) // 3)


def hole(nbytes: int) -> schema.Hole:
    """Room for the base64 of `nbytes` bytes: its length is planned now, its bytes written later."""
    return schema.Hole(b64_len(nbytes))


def kv_entries(*, n_layers: int, dim: int, counts: list[int], sources: list[str], source_counts: list[int],
               expert_source: list[int] | None = None, ridge: bool) -> list[tuple[str, str, object]]:
    """The statistics' key-values, with holes for the float blocks (filled by `write_blob`)."""
    mean_bytes, g_bytes = 4 * n_layers * dim, 4 * n_layers * dim * dim
    kv = [
        (schema.RS_COUNTS, "ARRAY", ("UINT64", [int(c) for c in counts])),
        (schema.RS_EXPERT_SOURCE, "ARRAY", ("UINT32", list(expert_source or [0] * len(counts)))),
        (schema.RS_SOURCES, "ARRAY", ("STRING", list(sources))),
        (schema.RS_SOURCE_COUNTS, "ARRAY", ("UINT64", [int(c) for c in source_counts])),
        (schema.RS_MEANS, "ARRAY", ("STRING", [hole(mean_bytes)] * len(counts))),
    ]
    if ridge:
        kv.append((schema.RS_SECOND_MOMENTS, "ARRAY", ("STRING", [hole(g_bytes)] * len(sources))))
    return kv


def write_blob(fd: int, offset: int, x: np.ndarray) -> int:
    """Write base64 of `x` as f32 at byte `offset` of `fd`, a few MB at a time; returns the length written."""
    raw = memoryview(np.ascontiguousarray(x, dtype="<f4")).cast("B")
    at = offset
    for i in range(0, len(raw), PIECE):
        at += pwrite_all(fd, np.frombuffer(base64.b64encode(raw[i:i + PIECE]), np.uint8), at)
    return at - offset


def read_blob(fd: int, offset: int, length: int, shape: tuple[int, ...]) -> np.ndarray:
    """The f32 array of `shape` whose base64 (`length` bytes) starts at byte `offset` of `fd`."""
    out = np.empty(shape, "<f4")
    raw = memoryview(out).cast("B")
    step = b64_len(PIECE)  # base64 of one whole piece: decodes to exactly PIECE bytes
    for i, j in zip(range(0, length, step), range(0, len(raw), PIECE)):
        b = os.pread(fd, min(step, length - i), offset + i)
        chunk = base64.b64decode(b, validate=True)
        raw[j:j + len(chunk)] = chunk
    return out
