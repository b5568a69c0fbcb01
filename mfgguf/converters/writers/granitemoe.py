"""granitemoe: the anchor is the always-on shared expert, the experts are routed beside it.

Every tensor is written as it streams: the anchor's FFN as `ffn_*_shexp`, expert i's FFN rows
into slot i of the stacked `ffn_*_exps`. With top-1 the selected weight is exactly 1, so a token
routed to expert i computes exactly what expert i was trained on. All of it is the base writer's.

Example:
    >>> GraniteMoeWriter(p, tmp, threads=2, progress=False)
"""

from __future__ import annotations

from mfgguf.converters.writers.base import Writer


class GraniteMoeWriter(Writer):
    """The base writer as it is: anchor tensors keep their `_shexp` slots, experts fill theirs."""
