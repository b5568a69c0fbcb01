"""The paired bootstrap over test documents: its point ratio is the mixed ratio, and its interval moves with the
documents, not with the models' shared difficulty."""

from __future__ import annotations

import math

import numpy as np
import pytest

from mfgguf.eval.spread import ratio_spread, spreads

RNG = np.random.default_rng(7)


def _model(doc_nll: dict[str, np.ndarray], n: dict[str, np.ndarray]) -> dict:
    """`measure`'s per-domain figures from per-document NLL sums and scored tokens."""
    out = {}
    for d in doc_nll:
        tot, k = float(doc_nll[d].sum()), int(n[d].sum())
        out[d] = {"ppl": math.exp(tot / k), "nll": tot / k, "n_tokens": k,
                  "documents": [[float(a), int(b)] for a, b in zip(doc_nll[d], n[d])]}
    return out


def _pair(shift: float, noise: float, docs: int = 20):
    n = {d: RNG.integers(50, 800, docs) for d in ("c", "man")}
    hard = {d: RNG.normal(2.0, 0.6, docs) for d in n}  # nats a token: documents differ a lot in difficulty
    a = {d: (hard[d] + shift + RNG.normal(0, noise, docs)) * n[d] for d in n}
    b = {d: hard[d] * n[d] for d in n}
    return _model(a, n), _model(b, n)


def test_the_point_ratio_is_the_mixed_perplexities_ratio():
    a, b = _pair(0.02, 0.05)
    s = ratio_spread(a, b, ["c", "man"])
    mix = lambda m: math.exp(sum(m[d]["nll"] * m[d]["n_tokens"] for d in m) / sum(m[d]["n_tokens"] for d in m))  # noqa: E731
    assert s["ratio"] == pytest.approx(mix(a) / mix(b), rel=1e-12)
    assert s["low"] <= s["ratio"] <= s["high"] and s["documents"] == {"c": 20, "man": 20}


def test_a_clear_margin_excludes_one_and_a_noisy_one_does_not():
    clear = ratio_spread(*_pair(0.05, 0.01), ["c", "man"])  # every document 0.05 nats worse
    assert clear["low"] > 1.04 and clear["a_better_share"] == 0.0
    noisy = ratio_spread(*_pair(0.0, 0.3), ["c", "man"])  # no difference, documents disagree
    assert noisy["low"] < 1 < noisy["high"] and 0.05 < noisy["a_better_share"] < 0.95
    # paired: the documents' own difficulty (shared by both models) does not widen the interval
    assert clear["high"] - clear["low"] < 0.01


def test_identical_models_give_an_interval_of_one():
    a, _ = _pair(0.0, 0.1)
    s = ratio_spread(a, a, ["c", "man"])
    assert (s["ratio"], s["low"], s["high"]) == (1.0, 1.0, 1.0)


def test_figures_without_documents_or_of_other_tokens_give_none():
    a, b = _pair(0.0, 0.1)
    old = {d: {k: v for k, v in f.items() if k != "documents"} for d, f in b.items()}
    assert ratio_spread(a, old, ["c", "man"]) is None
    other = {d: {**f, "documents": [[x, k + 1] for x, k in f["documents"]]} for d, f in b.items()}
    assert ratio_spread(a, other, ["c", "man"]) is None  # not the same scored tokens: no pairing
    assert set(spreads(a, {"cpt": b, "old": old}, ["c", "man"])) == {"cpt"}
