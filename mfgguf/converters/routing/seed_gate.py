"""The seed gate (`assemble --seed-gate C`, any MoE layout): the trunk's seed FFN routed as expert 0 beside *plain*
experts, so that text no expert knows can reach the base's own FFN (FlexOlmo keeps the public model's FFN as an
expert for that reason).

The assembled file then holds N + 1 routed experts: slot 0 is the seed (the trunk's `ffn_*_seed` tensors), slot
p >= 1 is the p-th selected expert; `mfgguf.complement` = true (the key's name is older than the gate: it says
"routed slot 0 is the seed") and `mfgguf.seed_gate` = C. Slot 0 is the untrained seed, so a token routed there at
top-1 computes anchor + seed: the trunk alone, which on an imported base is the base's FFN. Its row is C times the
sum of the N ridge rows. The ridge regresses one-hot domain labels, so on a shard's own text expert i scores about
1 (times the margin scale) and the sum of the scores about 1 in the training mix (a least-squares fit, negative for
a few tokens); the seed wins a token where no expert's score reaches C times that sum: where the regression is
unsure which domain this is, as on a domain no expert was trained for. C = 0.5 reads "no expert has a majority";
C is chosen on validation (`eval --seed-gates`).

Example:
    >>> seed_gate_rows([R], 0.5)[0].shape  # R: (N, dim)
    (N + 1, dim)
"""

from __future__ import annotations

import math

import numpy as np

from mfgguf.errors import MfggufError

SEED_SLOT = 0  # the seed's slot among the routed experts; expert p (0-based) is slot p + 1


def check(router: str, seed_expert: bool, seed_gate: float | None) -> bool:
    """Whether this assembly routes the seed as slot 0 (a seed gate is given); raises when the options do not fit."""
    if seed_gate is None:
        return False
    if router != "ridge":
        raise MfggufError(f"--seed-gate sets the seed's row from the ridge router's rows, not {router}'s; use"
                          " --router ridge")
    if not math.isfinite(seed_gate):
        raise MfggufError(f"--seed-gate {seed_gate} is not a number; use a value like 0.5")
    if not seed_expert:
        raise MfggufError("--seed-gate routes the trunk's seed FFN, and this trunk has none; retrain the trunk"
                          " with --seed-expert")
    return True  # any MoE layout holds the seed's slot (writers/seed_slot.py)


def seed_gate_rows(ridge: list[np.ndarray], seed_gate: float) -> list[np.ndarray]:
    """Router rows per layer (N + 1, dim) f32, seed first: C x the ridge rows' sum, then the N ridge rows (router.py's
    ridge over the N experts, per layer (N, dim))."""
    out = []
    for W in ridge:
        W = np.asarray(W, np.float64)  # (N, dim)
        out.append(np.concatenate([float(seed_gate) * W.sum(0, keepdims=True), W]).astype(np.float32))
    return out
