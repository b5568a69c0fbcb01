"""dense: no experts, the trunk alone as a plain `llama` file.

The anchor becomes the block's FFN (`ffn_*`). A trunk trained with a seed FFN (the FFN experts
start from) is the anchor + seed as one SwiGLU of width anchor_ff + expert_ff (joined.py): the
seed's rows follow the anchor's, and the anchor's down columns are written with the seed's.

Example:
    >>> DenseWriter(p, tmp, threads=2, progress=False)
"""

from __future__ import annotations

import numpy as np

from mfgguf.gguf.schema import blk
from mfgguf.converters.writers.joined import JoinedAnchorWriter


class DenseWriter(JoinedAnchorWriter):
    def _open_inputs(self) -> None:
        if self.p.cfg.seed_expert:  # anchor rows joined to the seed's
            super()._open_inputs()

    def _anchor_name(self, l: int, f: str) -> str | None:
        if f == "down" and self.p.cfg.seed_expert:
            return None  # joined with the seed's columns (_seed_chunk)
        return blk(l, f"ffn_{f}")

    def _seed_chunk(self, l: int, f: str, r0: int, x: np.ndarray) -> None:
        """The seed joined to the anchor, one SwiGLU of width anchor_ff + expert_ff."""
        s = self.p.slot(blk(l, f"ffn_{f}"))
        r0, x = self._after_anchor(l, f, r0, x)
        self._put(s, s.offset + r0 * s.row_bytes, x, owned=x is not self._chunk)  # joined rows: a new array
