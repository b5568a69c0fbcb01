"""How far apart a file's router rows are: two experts whose rows (nearly) coincide get the same logit for every
token, so the router cannot tell them apart and top-k picks between them by rounding.

The router of layer l is `blk.l.ffn_gate_inp.weight` (n_expert rows of n_embd, F32): a token's logits are the rows'
dot products with its FFN input, and the softmax over them depends only on the rows' differences. So a pair is
measured by the distance between its rows relative to the larger of the two (0: the same row), per layer; a layer
whose closest pair is below SAME is reported, as is a router whose rows are all equal (uniform routing, which
`assemble --router uniform` writes on purpose).

Example:
    >>> d = router_rows(Path("model.gguf"))
    >>> d["layers"][0]["closest"], d["warnings"]
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

SAME = 1e-3  # rows closer than this (relative) route alike to within rounding


def router_rows(path: Path, tensors=None) -> dict:
    """{"layers": [{"layer", "closest": relative distance of the closest pair, "pair": (slot a, slot b),
    "median": the median pair's distance}], "warnings": [one line each]} of a GGUF's router rows; {} without a router.
    `tensors` is the file's gguf-py tensor list where it is already read."""
    if tensors is None:
        import gguf

        tensors = gguf.GGUFReader(path).tensors
    routers = {int(t.name.split(".")[1]): t for t in tensors if t.name.endswith("ffn_gate_inp.weight")}
    if not routers:
        return {}
    layers, close, uniform = [], {}, []
    for l in sorted(routers):
        w = np.asarray(routers[l].data, dtype=np.float64).reshape(-1, int(routers[l].shape[0]))  # (n_expert, n_embd)
        n = len(w)
        if n < 2:
            continue
        norm = np.linalg.norm(w, axis=1)  # (n_expert,)
        d = np.linalg.norm(w[:, None] - w[None], axis=-1) / np.maximum(np.maximum(norm[:, None], norm[None]), 1e-30)
        iu = np.triu_indices(n, 1)
        rel = d[iu]  # (pairs,)
        k = int(np.argmin(rel))
        layers.append({"layer": l, "closest": float(rel[k]), "pair": (int(iu[0][k]), int(iu[1][k])),
                       "median": float(np.median(rel))})
        if rel.max() < SAME:
            uniform.append(l)
        elif rel[k] < SAME:
            close.setdefault((int(iu[0][k]), int(iu[1][k])), []).append(l)
    warnings = []
    if uniform:
        warnings.append(f"every router row is the same in {_spans(uniform)}: routing there is uniform, the experts"
                        " cannot be told apart (`assemble --router ridge` computes rows from their statistics)")
    for (a, b), ls in close.items():
        warnings.append(f"experts in slots {a} and {b} have router rows within {SAME:g} of each other in {_spans(ls)}:"
                        " the router cannot tell them apart there (trained on the same data? see docs/assembly.md)")
    return {"layers": layers, "warnings": warnings}


def _spans(layers: list[int]) -> str:
    """`layers 0-3, 7` from [0, 1, 2, 3, 7]."""
    out, start = [], layers[0]
    for a, b in zip(layers, layers[1:] + [None]):
        if b != a + 1:
            out.append(f"{start}-{a}" if a > start else f"{a}")
            start = b
    return ("layer " if len(layers) == 1 else "layers ") + ", ".join(out)


__all__ = ["SAME", "router_rows"]
