"""The router's statistics in the GGUF: a block after the tensor data that lets `mfgguf extend` recompute the router.

What extend needs: per expert slot its FFN-input means (layers, dim) f32 and token count, per
source (one RUN's pooled statistics) its second moment G (layers, dim, dim) f32 and token count,
and which source each expert came with. The small items are key-values under `mfgguf.router.`
(schema.py declares them). The float blocks are raw little-endian f32 in one block past the last
tensor, at the offset `mfgguf.router.stats_offset` gives (relative to the data section, as tensor
offsets are, so a tool that rewrites only the header and copies the rest, like `mfgguf calibrate`,
keeps it valid):

    [header][tensor data][zeros to ALIGNMENT][means: N x (layers, dim)][G: S x (layers, dim, dim), ridge only]

No GGUF reader looks there: llama.cpp and gguf-py read the tensors at their offsets, and llama.cpp
maps the file without touching those pages. In the header, as base64 key-values (the format before
this one), llama.cpp formatted every byte while it loaded (seconds and hundreds of MB of peak RSS for a `1b`
block: docs/assembly.md), and the same again in assembly's own re-read check. A tool that rewrites the file (llama.cpp's
quantizer, gguf-py) drops the block: the file size then no longer equals offset + block length, and
extend says so instead of reading foreign bytes.

Example:
    >>> kv = kv_entries(n_layers=2, dim=64, counts=[10, 12], sources=["ab.."], source_counts=[22], ridge=True)
    >>> at = StatsBlock(offset, n_layers=2, dim=64, n_experts=2, n_sources=1, ridge=True)
    >>> pwrite_all(fd, means_of_expert_0, at.mean(0)); pwrite_all(fd, G_of_layer_1, at.second_moment(0, 1))
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from mfgguf.gguf import schema
from mfgguf.gguf.schema import ALIGNMENT


def kv_entries(*, n_layers: int, dim: int, counts: list[int], sources: list[str], source_counts: list[int],
               expert_source: list[int] | None = None, ridge: bool, offset: int = 0) -> list[tuple[str, str, object]]:
    """The statistics' key-values; `offset` (where the block starts in the data section) is set once the
    tensors are placed (`with_offset`): a UINT64, so the header's length does not depend on it."""
    return [
        (schema.RS_COUNTS, "ARRAY", ("UINT64", [int(c) for c in counts])),
        (schema.RS_EXPERT_SOURCE, "ARRAY", ("UINT32", list(expert_source or [0] * len(counts)))),
        (schema.RS_SOURCES, "ARRAY", ("STRING", list(sources))),
        (schema.RS_SOURCE_COUNTS, "ARRAY", ("UINT64", [int(c) for c in source_counts])),
        (schema.RS_RIDGE, "BOOL", bool(ridge)),
        (schema.RS_OFFSET, "UINT64", int(offset)),
    ]


def with_offset(kv: list[tuple[str, str, object]], offset: int) -> list[tuple[str, str, object]]:
    return [(k, t, offset if k == schema.RS_OFFSET else v) for k, t, v in kv]


def block_start(data_end: int) -> int:
    """Where the block starts for tensor data ending at byte `data_end` (of the file, or of the data section)."""
    return (data_end + ALIGNMENT - 1) // ALIGNMENT * ALIGNMENT


@dataclass(frozen=True)
class StatsBlock:
    """Byte offsets (absolute, in the file) of the block's arrays."""

    offset: int  # in the file
    n_layers: int
    dim: int
    n_experts: int
    n_sources: int
    ridge: bool

    @property
    def mean_bytes(self) -> int:
        return 4 * self.n_layers * self.dim

    @property
    def layer_bytes(self) -> int:
        return 4 * self.dim * self.dim

    @property
    def nbytes(self) -> int:
        g = self.n_sources * self.n_layers * self.layer_bytes if self.ridge else 0
        return self.n_experts * self.mean_bytes + g

    @property
    def end(self) -> int:
        return self.offset + self.nbytes

    def mean(self, p: int) -> int:
        """Expert slot p's means, (layers, dim) f32."""
        return self.offset + p * self.mean_bytes

    def second_moment(self, j: int, layer: int = 0) -> int:
        """Source j's G of `layer`, (dim, dim) f32; its layers follow each other."""
        return self.offset + self.n_experts * self.mean_bytes + (j * self.n_layers + layer) * self.layer_bytes

    @classmethod
    def of_header(cls, value, data_offset: int) -> "StatsBlock | None":
        """The block a GGUF header (`value(key)`, data section at `data_offset`) describes, or None when it
        has none."""
        off = value(schema.RS_OFFSET)
        if off is None:
            return None
        arch = value("general.architecture")
        return cls(data_offset + int(off), int(value(f"{arch}.block_count")), int(value(f"{arch}.embedding_length")),
                   len(value(schema.RS_COUNTS) or []), len(value(schema.RS_SOURCES) or []), bool(value(schema.RS_RIDGE)))


def read_f32(fd: int, offset: int, shape: tuple[int, ...]) -> np.ndarray:
    """The f32 array of `shape` at byte `offset` of `fd`."""
    from mfgguf.gguf.fileio import pread_into

    return pread_into(fd, np.empty(shape, "<f4"), offset, "the file ends inside its router statistics; re-assemble it")
