"""Writers whose FFNs join the anchor to other rows: one SwiGLU of width anchor_ff + expert_ff.

mixtral joins the anchor to every expert, dense (the trunk alone, with a seed FFN) to the seed.
Gate/up rows of the joined FFN are the anchor's anchor_ff rows, then the other FFN's; down rows
(dim, anchor_ff + expert_ff) are the anchor's columns, then the other's. The anchor's rows are
read back from the trunk (or from mixtral's merge scratch file) with pread while the other FFN
streams.

Example:
    >>> r0, x = w._after_anchor(l, "down", r0, x)  # x: (rows, expert_ff) -> (rows, anchor_ff + expert_ff)
"""

from __future__ import annotations

import os

import numpy as np

from mfgguf.gguf.fileio import pread_into
from mfgguf.gguf.schema import blk
from mfgguf.converters.writers.base import Writer


class JoinedAnchorWriter(Writer):
    """The trunk stays open beside the stream, so the anchor's rows can be joined to others."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.anchor_fd: int | None = None  # the trunk, readable for the joined anchor
        self.scratch = None  # mixtral with a merged anchor: its f32 rows (unnamed file beside the output)
        self.scratch_at: dict[str, int] = {}  # merged anchor tensor -> byte offset in the scratch file

    def close(self) -> None:
        super().close()
        if self.scratch is not None:
            self.scratch.close()
            self.scratch = None
        if self.anchor_fd is not None:
            os.close(self.anchor_fd)
            self.anchor_fd = None

    def _open_inputs(self) -> None:
        self.anchor_fd = os.open(self.p.trunk.path, os.O_RDONLY)

    def _after_anchor(self, l: int, f: str, r0: int, x: np.ndarray) -> tuple[int, np.ndarray]:
        """Rows r0.. of an expert-width FFN tensor placed after the anchor in one wider SwiGLU: gate/up
        rows follow the anchor's anchor_ff rows; down rows (dim, expert_ff) get the anchor's columns first."""
        if f == "down":
            a = self._anchor_rows(blk(l, "ffn_down_shexp"), r0, r0 + len(x))  # (rows, anchor_ff)
            return r0, np.concatenate([a, x], axis=1)  # (rows, anchor_ff + expert_ff)
        return r0 + self.p.cfg.anchor_ff, x

    def _anchor_rows(self, name: str, r0: int, r1: int) -> np.ndarray:
        """Rows r0:r1 of anchor tensor `name`: the merged ones from the scratch file, else the trunk's."""
        e = self.p.trunk.entries[name]
        cols = e.shape[-1]
        buf = np.empty((r1 - r0, cols), np.float32)
        if name in self.scratch_at:
            pread_into(self.scratch.fileno(), buf, self.scratch_at[name] + r0 * cols * 4,
                       "the merge scratch file ended early; retrain it")
        else:
            pread_into(self.anchor_fd, buf, e.begin + r0 * cols * 4, "the trunk module ended early; retrain it")
        return buf
