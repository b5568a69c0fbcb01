"""qwen2moe: granitemoe's layout (the anchor as the shared expert) for a qwen2 trunk, whose shared expert is gated.

llama.cpp's qwen2moe graph multiplies the shared expert's output by sigmoid(ffn_gate_inp_shexp . x),
computed as silu(z) / z, where x is the FFN input. No row makes z a constant for every x, but a tiny
one makes the gate a constant: every entry 2^-64 (schema.SHEXP_GATE_LOGIT_SCALE) gives |z| < 2^-25
for any sane activation, so exp(-z) rounds to 1 in f32 and the gate is z / 2 / z = 0.5 exactly (z is
0, and the gate NaN, only if the FFN input sums to exactly 0). The anchor's down projection is written
doubled: 0.5 * (2 D) h is D h bit for bit (scaling by a power of two is exact, in every quant type's
block scales too). The routed experts are weighted by their softmax probabilities, which qwen2moe
does not renormalise over the top-k (llama.cpp passes norm_w = false).

Example:
    >>> Qwen2MoeWriter(p, tmp, threads=2, progress=False)
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from mfgguf.converters.writers.base import FFN_RE, Writer

GATE = 0.5  # the shared expert's constant gate


def _shexp_down(name: str) -> bool:
    m = FFN_RE.fullmatch(name)
    return m is not None and m.group(2) == "down" and m.group(3) is not None


class Qwen2MoeWriter(Writer):
    def _trunk_chunk(self, name: str, r0: int, x: np.ndarray) -> None:
        if name not in self.p.merged and _shexp_down(name):
            s = self.p.slot(name)
            self._put(s, s.offset + r0 * s.row_bytes, x / GATE, owned=True)
            return
        super()._trunk_chunk(name, r0, x)

    def _merged_writer(self, name: str) -> Callable[[int, np.ndarray], None]:
        write = super()._merged_writer(name)
        if not _shexp_down(name):
            return write
        return lambda r0, x: write(r0, x / GATE)
