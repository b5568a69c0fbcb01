"""A new expert's slot in a file whose layout folds the anchor into every expert (llama with experts; qwen3moe, Qwen3's only).

Such a slot is one SwiGLU of width anchor_ff + expert_ff, written as assembly writes it (writers/mixtral.py,
joined.py): gate/up rows are the anchor's anchor_ff rows, then the expert's; down rows are the anchor's
columns, then the expert's. Rows quantize independently, so the anchor's gate/up rows are the same bytes in
every slot: a new slot takes them from one already in the file, whatever the trunk module. A down row's
blocks can mix anchor and expert columns, so those rows are joined from f32: the anchor's columns are read
from the --add RUN's trunk (checked to be the file's, and hashed as it streams beside the experts).

Example:
    >>> with Fold(src.anchor_ff, adds.trunk) as fold:
    ...     for r, y in fold.rows(l, "down", r0, x): ...  # x: (rows, expert_ff) -> y: (rows, anchor_ff + expert_ff)
"""

from __future__ import annotations

import os
from typing import Iterator

import numpy as np

from mfgguf.gguf.fileio import pread_into, truncated
from mfgguf.modules.merge import open_checked
from mfgguf.modules.module import Module
from mfgguf.converters.stream import CHUNK_BYTES
from mfgguf.gguf.schema import blk


class Fold:
    """Where a new expert's rows go in its folded slot; a context manager holding the trunk open for the anchor."""

    def __init__(self, anchor_ff: int, trunk: Module):
        self.anchor_ff, self.trunk = anchor_ff, trunk
        self.fd = -1

    def __enter__(self) -> "Fold":
        self.fd = open_checked(self.trunk)
        return self

    def __exit__(self, *exc) -> None:
        os.close(self.fd)
        self.fd = -1

    def anchor_rows(self, f: str) -> int:
        """Rows of a new slot's ffn_{f}_exps copied from a slot in the file: the anchor's gate/up, no down row."""
        return self.anchor_ff if f in ("gate", "up") else 0

    def rows(self, l: int, f: str, r0: int, x: np.ndarray) -> Iterator[tuple[int, np.ndarray]]:
        """(first row in the slot, rows) for rows r0.. of an expert's ffn_{f} chunk `x`; down rows joined with the
        anchor's columns, a few at a time (the joined rows are (anchor_ff + expert_ff) / expert_ff times wider)."""
        if f != "down":
            yield self.anchor_ff + r0, x
            return
        e = self.trunk.entries[blk(l, "ffn_down_shexp")]
        A, E = self.anchor_ff, x.shape[1]
        step = max(1, CHUNK_BYTES // ((A + E) * 4))
        for i in range(0, len(x), step):
            j = min(len(x), i + step)
            a = pread_into(self.fd, np.empty((j - i, A), np.float32), e.begin + (r0 + i) * A * 4, truncated(self.trunk))
            yield r0 + i, np.concatenate([a, x[i:j]], axis=1)
