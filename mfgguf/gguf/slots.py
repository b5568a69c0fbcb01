"""What each routed slot of an assembled file holds: the seed (the base's own FFN) where the file routes it, then
the experts in slot order, each with the id, label, tokens and trunk `assemble` wrote for it (converters/plan/names.py).

`mfgguf.experts` lists the experts' ids and the name keys their entries, in expert order; a file assembled with
`--seed-gate` routes the seed in slot 0, before them.

Example:
    >>> routed_slots(read_gguf_header(Path("model.gguf")).value)[0]
    {'slot': 0, 'id': 2, 'label': 'cpp', 'tokens': 32768, 'trunk': '1a2b...'}
"""

from __future__ import annotations

SEED_LABEL = "the base's own FFN (seed)"


def routed_slots(value) -> list[dict]:
    """One dict a routed slot, from a header's `value(key, default=None)`: {"slot", "id" (None for the seed),
    "label", "tokens", "trunk"}."""
    arch = value("general.architecture")
    n = int(value(f"{arch}.expert_count") or 0)
    seed = bool(value("mfgguf.complement")) or value("mfgguf.seed_gate") is not None
    ids = list(value("mfgguf.experts") or range(1, n + 1 - seed))
    labels, tokens, trunks = (list(value(k) or []) for k in ("mfgguf.expert_labels", "mfgguf.expert_tokens",
                                                             "mfgguf.expert_trunk_sha256"))
    out = []
    for s in range(n):
        e = s - seed  # the expert's place among the experts; -1: the seed's slot
        if e < 0:
            out.append({"slot": s, "id": None, "label": SEED_LABEL, "tokens": None, "trunk": None})
            continue
        at = lambda xs: xs[e] if e < len(xs) else None  # noqa: E731
        i = at(ids)
        out.append({"slot": s, "id": int(i) if i is not None else None,
                    "label": at(labels) or (f"expert {i}" if i is not None else f"slot {s}"),
                    "tokens": at(tokens), "trunk": at(trunks)})
    return out


__all__ = ["SEED_LABEL", "routed_slots"]
