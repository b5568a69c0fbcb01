"""The seed as routed expert 0: the writers of plain experts with a seed gate (`assemble --seed-gate`, every MoE
layout).

The trunk's seed FFN (`ffn_*_seed`) streams into slot 0 of the stacked `ffn_*_exps`, placed as the layout
places an expert's rows (the folded layout, llama and qwen3moe: after the anchor's, which the fold phase writes into every
slot, the seed's too), expert p's FFN into slot p + 1, and the router phase writes (N + 1, dim) rows per layer:
converters/routing/seed_gate.py says which.

Example:
    >>> SEED_SLOT_WRITERS["shared-expert"](p, tmp, threads=2, progress=False)  # p.routed_seed is True
"""

from __future__ import annotations

import numpy as np

from mfgguf.converters.routing.router import RouterBuilder
from mfgguf.converters.routing.seed_gate import SEED_SLOT, seed_gate_rows
from mfgguf.gguf.schema import blk
from mfgguf.converters.writers.base import STATS_RE, Writer
from mfgguf.converters.writers.granitemoe import GraniteMoeWriter
from mfgguf.converters.writers.mixtral import MixtralWriter
from mfgguf.converters.writers.qwen2moe import Qwen2MoeWriter


class SeedSlot(Writer):
    """Seed in slot 0, experts after it, router rows over N + 1 slots: mixed in before a layout's writer."""

    def _router_builder(self) -> RouterBuilder:
        # the ridge rows over the N experts: the seed's row derives from them
        return RouterBuilder("ridge", n_layers=self.p.cfg.n_layers, dim=self.p.cfg.dim, n_experts=len(self.p.experts),
                             pooled=self._pooled_layer)

    def _seed_chunk(self, l: int, f: str, r0: int, x: np.ndarray) -> None:
        placed = self._expert_rows(l, f, r0, x)  # where the layout puts an expert's rows (folded: after the anchor)
        assert placed is not None, "a folded layout whose anchor is merged places no seed rows (plan refuses it)"
        r0, x = placed
        s = self.p.slot(blk(l, f"ffn_{f}_exps"))
        self._put(s, s.offset + SEED_SLOT * s.expert_bytes + r0 * s.row_bytes, x, owned=x is not self._chunk)

    def _expert_chunk(self, slot_i: int, count: int, name: str, r0: int, x: np.ndarray) -> None:
        if (st := STATS_RE.fullmatch(name)) is not None:
            self.rb.add_mean(slot_i, int(st.group(1)), x.reshape(-1), count)
            return
        super()._expert_chunk(slot_i + 1, count, name, r0, x)  # after the seed's slot

    def router(self) -> None:
        self._enter("router", "fold")
        for l, w in enumerate(seed_gate_rows(self.rb.finish(), self.p.seed_gate)):  # (N + 1, C)
            s = self.p.slot(blk(l, "ffn_gate_inp"))
            self._put(s, s.offset, w)
        self.rb = None


class SeedSlotGraniteMoeWriter(SeedSlot, GraniteMoeWriter):
    """granitemoe: the anchor as the shared expert, the seed and the experts routed beside it."""


class SeedSlotMixtralWriter(SeedSlot, MixtralWriter):
    """The folded layout (llama, qwen3moe): the anchor folded into every slot, the seed's too."""


class SeedSlotQwen2MoeWriter(SeedSlot, Qwen2MoeWriter):
    """qwen2moe: the anchor as the gated shared expert, the seed and the experts routed beside it."""


SEED_SLOT_WRITERS: dict[str, type[Writer]] = {"shared-expert": SeedSlotGraniteMoeWriter, "folded": SeedSlotMixtralWriter,
                                             "qwen2moe": SeedSlotQwen2MoeWriter}
