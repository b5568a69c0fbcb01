"""mixtral (`llama` arch with experts): no shared expert, so the anchor is folded into every expert.

llama.cpp renormalises the top-k softmax weights and has no shared expert. Expert i' is one SwiGLU
of width anchor_ff + expert_ff (joined.py) that computes anchor(x) + expert_i(x) exactly; since the
renormalised weights sum to 1, sum_j w_j (anchor + e_j) = anchor + sum_j w_j e_j for any top-k:
the same function as granitemoe. The anchor's own tensors are not written; its rows go into every
expert slot in the fold phase. A merged anchor (experts trained with `--shared all`) is merged once
into an unnamed f32 scratch file beside the output and folded from there; the experts' down rows
then wait for it (fold phase) instead of being joined while they stream.

Example:
    >>> MixtralWriter(p, tmp, threads=2, progress=False)
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Callable

import numpy as np

from mfgguf.gguf.fileio import pread_into, pwrite_all
from mfgguf.converters.plan.layout import Plan
from mfgguf.modules.merge import open_checked
from mfgguf.gguf.schema import blk
from mfgguf.converters.stream import CHUNK_BYTES
from mfgguf.converters.writers.base import FFN_RE
from mfgguf.converters.writers.joined import JoinedAnchorWriter


class MixtralWriter(JoinedAnchorWriter):
    def __init__(self, p: Plan, path: Path, *args, **kw):
        super().__init__(p, path, *args, **kw)
        self.deferred_down: set[str] = set()  # merged anchor down tensors, joined in the fold phase
        if any(FFN_RE.fullmatch(n) for n in p.merged):
            self.scratch = tempfile.TemporaryFile(dir=path.parent)
            self.deferred_down = {n for n in p.merged if n.endswith("ffn_down_shexp.weight")}

    def _anchor_name(self, l: int, f: str) -> str | None:
        return None  # folded into every expert slot (_fold)

    def _expert_rows(self, l: int, f: str, r0: int, x: np.ndarray) -> tuple[int, np.ndarray] | None:
        if f == "down" and blk(l, "ffn_down_shexp") in self.deferred_down:
            return None  # joined with the merged anchor in the fold phase
        return self._after_anchor(l, f, r0, x)  # anchor + expert i as one SwiGLU

    def _merged_writer(self, name: str) -> Callable[[int, np.ndarray], None]:
        if self.scratch is None or FFN_RE.fullmatch(name) is None:
            return super()._merged_writer(name)
        self.scratch_at[name] = base = os.fstat(self.scratch.fileno()).st_size  # a merged anchor tensor
        return lambda r0, x: pwrite_all(self.scratch.fileno(), x, base + r0 * x.shape[1] * 4)

    def _fold(self) -> None:
        for slot_i in range(len(self.p.expert_modules) + self.p.routed_seed):  # the seed's slot 0 too, where routed
            self._fold_anchor_rows(slot_i)

    def _fold_anchor_rows(self, slot_i: int) -> None:
        """The first anchor_ff rows of expert slot_i's gate/up are the anchor's; with a merged
        anchor the down rows (anchor columns, then the expert's) are joined here too."""
        p, cfg = self.p, self.p.cfg
        for l in range(cfg.n_layers):
            for f in ("gate", "up"):
                s = p.slot(blk(l, f"ffn_{f}_exps"))
                base = s.offset + slot_i * s.expert_bytes
                src = blk(l, f"ffn_{f}_shexp")
                step = max(1, CHUNK_BYTES // (cfg.dim * 4))
                for r0 in range(0, cfg.anchor_ff, step):
                    r1 = min(cfg.anchor_ff, r0 + step)
                    self._put(s, base + r0 * s.row_bytes, self._anchor_rows(src, r0, r1), owned=True)
            if blk(l, "ffn_down_shexp") in self.deferred_down:
                s = p.slot(blk(l, "ffn_down_exps"))
                base = s.offset + slot_i * s.expert_bytes
                mod = p.expert_modules[slot_i - p.routed_seed]  # a routed seed's slot: refused with a merged anchor
                e = mod.entries[blk(l, "ffn_down")]
                step = max(1, CHUNK_BYTES // ((cfg.anchor_ff + cfg.expert_ff) * 4))
                fd = open_checked(mod)
                try:
                    for r0 in range(0, cfg.dim, step):
                        r1 = min(cfg.dim, r0 + step)
                        x = np.empty((r1 - r0, cfg.expert_ff), np.float32)  # (rows, expert_ff)
                        pread_into(fd, x, e.begin + r0 * cfg.expert_ff * 4, f"module {mod.name} ended early; retrain it")
                        a = self._anchor_rows(blk(l, "ffn_down_shexp"), r0, r1)  # (rows, anchor_ff)
                        self._put(s, base + r0 * s.row_bytes, np.concatenate([a, x], axis=1), owned=True)
                finally:
                    os.close(fd)
