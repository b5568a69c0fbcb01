"""How far a ratio of test perplexities moves with the test documents drawn: a paired bootstrap over documents.

A study's test split holds a few dozen documents a domain, and two models' mixed perplexities can differ by
less than what swapping a few of them moves. Seeds give the spread of training; this gives the spread of the
test sample, for one trained pair. Both models score the same tokens in the same windows (`measure` on the
test split keeps each document's NLL sum and scored tokens), so one draw resamples each domain's documents with
replacement, the same documents for both (paired), as many as the domain has (stratified: the mix keeps its
domains' weights in expectation), and takes the ratio of the two token-weighted mixed perplexities.

Example:
    >>> s = ratio_spread(results[moe]["domains"], results[cpt]["domains"], ["c", "cpp", "man", "python"])
    >>> s["ratio"], s["low"], s["high"]   # point ratio and its interval (LEVEL) over test documents
"""

from __future__ import annotations

import numpy as np

DRAWS = 2000  # bootstrap draws: enough that the interval's ends move in the third decimal between seeds of the draw
LEVEL = 0.95  # the interval's coverage


def documents(per: dict, domains: list[str]) -> dict[str, np.ndarray] | None:
    """Each domain's (documents, 2) array of [NLL sum, scored tokens], or None where a domain lacks them (a
    measurement from before documents were kept, or of the validation split)."""
    if any("documents" not in (per.get(d) or {}) for d in domains):
        return None
    return {d: np.asarray(per[d]["documents"], dtype=np.float64).reshape(-1, 2) for d in domains}


def ratio_spread(a: dict, b: dict, domains: list[str], *, draws: int = DRAWS, level: float = LEVEL,
                 seed: int = 0) -> dict | None:
    """Model a's mixed test perplexity over model b's on `domains`, and its interval over resampled documents.

    `a` and `b` map a domain to `measure`'s figures for it (with "documents"). Returns {"ratio", "low", "high",
    "level", "draws", "a_better_share" (the draws where a's perplexity is lower), "documents" (counted a domain)},
    or None where either model lacks per-document figures or the two did not score the same tokens."""
    da, db = documents(a, domains), documents(b, domains)
    if da is None or db is None or any(da[d].shape != db[d].shape or (da[d][:, 1] != db[d][:, 1]).any() for d in domains):
        return None
    rng = np.random.default_rng(seed)
    diff, n = np.zeros(draws), np.zeros(draws)  # per draw: NLL sum of a minus b, scored tokens
    for d in domains:
        k = len(da[d])
        pick = rng.integers(0, k, size=(draws, k))  # (draws, k) documents drawn, with replacement
        diff += (da[d][:, 0] - db[d][:, 0])[pick].sum(1)
        n += da[d][:, 1][pick].sum(1)
    r = np.exp(diff / n)  # (draws,) ratio of the two mixed perplexities in each draw
    point = float(np.exp(sum((da[d][:, 0] - db[d][:, 0]).sum() for d in domains) / sum(da[d][:, 1].sum() for d in domains)))
    lo, hi = np.quantile(r, [(1 - level) / 2, (1 + level) / 2])
    return {"ratio": point, "low": float(lo), "high": float(hi), "level": level, "draws": draws,
            "a_better_share": float((r < 1).mean()), "documents": {d: len(da[d]) for d in domains}}


def spreads(moe: dict, others: dict[str, dict], domains: list[str]) -> dict:
    """`ratio_spread` of the MoE's per-domain figures over each of `others` (a key -> its per-domain figures), for
    those that kept per-document figures."""
    out = {k: ratio_spread(moe, o, domains) for k, o in others.items()}
    return {k: v for k, v in out.items() if v is not None}


__all__ = ["DRAWS", "LEVEL", "documents", "ratio_spread", "spreads"]
