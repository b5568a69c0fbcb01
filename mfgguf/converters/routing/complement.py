"""Assembling experts that complement the seed: the seed FFN becomes routed expert 0, and the router.

A complementing expert (`train-expert --complement`, train/experts/complement.py) trained as a two-way MoE
of [frozen seed FFN, its own FFN] beside the anchor, gated like llama.cpp's granitemoe gates:
softmax over the router rows, top-2 of 2, weights renormalised over the selected. Its module file
holds its FFN, its learned router row `complement.blk.{l}.router` (dim,) and `"complement": true`
in its metadata. The seed's row was frozen at zero during training, so the learned row is the
logit of the expert against the seed: gate(x) = sigmoid(x . r_i).

The assembled granitemoe file then holds N + 1 routed experts: slot 0 is the seed (the trunk's
`ffn_*_seed` tensors), slot p >= 1 is the p-th selected expert; `mfgguf.complement` = true. With
top-k = 2, a token whose two selected slots are the seed and expert i computes exactly what
expert i trained (the renormalised weights of two selected slots are the softmax over just
their two logits, and only logit differences count). Top-k is the user's; 2 is the trained one.

Routers (`assemble --router`), rows per layer (N + 1, dim):
  learned        [0, r_1 .. r_N]: the rows as trained (FlexOlmo's merge: rows concatenated).
                 Nothing trained r_i against the other experts' domains, so the seed is picked
                 only where at most one expert's logit is positive.
  ridge          the closed-form ridge router (router.py) over the N experts, with the seed as a
                 class whose label is 1 for every token: by linearity its row is the sum of the N
                 ridge rows (same scale). In domain i the seed and expert i both score about the
                 margin and the others about 0: top-2 = {seed, i}, weights near 1/2 each.
  ridge+learned  ridge's rows, plus r_i on expert i's row: ridge selects {seed, i}, and since the
                 two ridge logits are about equal there, their difference is about the trained gate.

The seed gate (`assemble --seed-gate C`, any MoE layout): the seed routed the same way beside *plain*
experts, so that text no expert knows can reach the base's own FFN (FlexOlmo keeps the public model's
FFN as an expert for that reason). Slot 0 is the untrained seed, so a token routed there at top-1
computes anchor + seed: the trunk alone, which on an imported base is the base's FFN. Its row is C
times the sum of the N ridge rows. The ridge regresses one-hot domain labels, so on a shard's own text
expert i scores about 1 (times the margin scale) and the sum of the scores about 1 in the training mix
(a least-squares fit, negative for a few tokens); the seed wins a token where no expert's score
reaches C times that sum: where the regression is unsure which domain this is, as on a domain no
expert was trained for. C = 0.5 reads "no expert has a majority"; C is chosen on validation
(`eval --seed-gates`).

Example:
    >>> complement_rows("ridge+learned", ridge=[R], learned=[L])[0].shape  # R, L: (N, dim)
    (N + 1, dim)
"""

from __future__ import annotations

import math

import numpy as np

from mfgguf.errors import MfggufError

LEARNED_ROW = "complement.blk.{l}.router"  # a complementing expert's learned router row of layer l, (dim,)
ROUTERS = ("learned", "ridge", "ridge+learned")  # the routers of an assembly with complementing experts
SEED_SLOT = 0  # the seed's slot among the routed experts; expert p (0-based) is slot p + 1


def is_complement(meta: dict) -> bool:
    return bool(meta.get("complement"))


def check(router: str, layout: str, seed_expert: bool, names: list[str], flags: list[bool],
          seed_gate: float | None = None) -> bool:
    """Whether this assembly routes the seed as slot 0 (every selected expert complements it, or a seed gate is
    given for plain experts); raises when the selection or the options do not fit."""
    if seed_gate is not None:
        if any(flags):
            raise MfggufError("--seed-gate routes the seed beside plain experts; these complement it already (their"
                              " assembly routes it): drop --seed-gate")
        if router != "ridge":
            raise MfggufError(f"--seed-gate sets the seed's row from the ridge router's rows, not {router}'s; use"
                              " --router ridge")
        if not math.isfinite(seed_gate):
            raise MfggufError(f"--seed-gate {seed_gate} is not a number; use a value like 0.5")
        if not seed_expert:
            raise MfggufError("--seed-gate routes the trunk's seed FFN, and this trunk has none; retrain the trunk"
                              " with --seed-expert")
        return True  # any MoE layout holds the seed's slot (writers/complement.py)
    on = any(flags)
    if on and not all(flags):
        odd = [n for n, f in zip(names, flags) if not f]
        raise MfggufError(f"{odd[0]} does not complement the seed but other selected experts do; retrain it with"
                          " `train-expert --complement` or leave it out with --experts")
    if router in ROUTERS[:1] + ROUTERS[2:] and not on:
        raise MfggufError(f"--router {router} needs experts trained with `train-expert --complement`; use ridge")
    if not on:
        return False
    if router not in ROUTERS:
        raise MfggufError(f"--router {router} does not route the seed; with complementing experts use one of"
                          f" {', '.join(ROUTERS)}")
    if layout != "granitemoe":
        raise MfggufError("complementing experts assemble into the granitemoe layout only; pass --layout granitemoe")
    if not seed_expert:
        raise MfggufError("complementing experts need the trunk's seed FFN, and this trunk has none; retrain the"
                          " trunk with --seed-expert")
    return True


def learned_shapes(n_layers: int, dim: int) -> dict[str, tuple[int, ...]]:
    return {LEARNED_ROW.format(l=l): (dim,) for l in range(n_layers)}


def complement_rows(router: str, *, ridge: list[np.ndarray] | None, learned: list[np.ndarray],
                    seed_gate: float | None = None) -> list[np.ndarray]:
    """Router rows per layer (N + 1, dim) f32, seed first. `ridge`: per layer (N, dim) rows of router.py's
    ridge over the N experts (None for `learned`); `learned`: per layer (N, dim) rows the experts trained (zeros
    for plain experts); `seed_gate`: C, the seed's row C x the ridge rows' sum (1 without)."""
    out = []
    for l, L in enumerate(learned):
        L = np.asarray(L, np.float64)  # (N, dim)
        if router == "learned":
            R = np.concatenate([np.zeros((1, L.shape[1])), L])  # (N + 1, dim)
        else:
            W = np.asarray(ridge[l], np.float64)  # (N, dim)
            c = 1.0 if seed_gate is None else float(seed_gate)
            R = np.concatenate([c * W.sum(0, keepdims=True), W + (L if router == "ridge+learned" else 0.0)])
        out.append(R.astype(np.float32))
    return out
