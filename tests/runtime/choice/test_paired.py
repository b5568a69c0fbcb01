"""Two models' verdicts on the same tasks compared task by task: the point, its paired interval, McNemar's p."""

from __future__ import annotations

import math

import numpy as np
import pytest

from mfgguf.errors import MfggufError
from mfgguf.runtime.choice.paired import mcnemar, paired


def _record(right, ids=None):
    return {"task_ids": list(range(len(right))) if ids is None else ids, "right": list(right)}


def test_mcnemar_is_the_exact_binomial_tail():
    assert mcnemar(10, 2) == pytest.approx(2 * sum(math.comb(12, k) for k in range(3)) / 2 ** 12)
    assert mcnemar(5, 5) == 1.0 and mcnemar(0, 0) == 1.0


def test_the_paired_interval_is_tight_where_the_models_agree_and_holds_the_point():
    rng = np.random.default_rng(0)
    base = rng.integers(0, 2, 2000)
    close = base.copy()
    flip = rng.choice(2000, 40, replace=False)
    close[flip] = 1 - close[flip]  # 40 discordant tasks
    far = rng.integers(0, 2, 2000)  # no relation to the base's verdicts
    a, b = paired(_record(close), _record(base)), paired(_record(far), _record(base))
    assert a["low"] <= a["points"] <= a["high"] and b["low"] <= b["points"] <= b["high"]
    assert a["only_a"] + a["only_b"] == 40
    assert a["high"] - a["low"] < 0.3 * (b["high"] - b["low"])  # pairing: only the discordant tasks move it


def test_tasks_are_matched_by_their_index_and_other_sets_are_refused():
    a = _record([1, 0, 1], ids=[7, 3, 5])
    b = _record([1, 1, 0], ids=[3, 5, 7])  # task 7: 1 vs 0, task 3: 0 vs 1, task 5: 1 vs 1
    r = paired(a, b)
    assert (r["only_a"], r["only_b"], r["points"]) == (1, 1, 0.0)
    with pytest.raises(MfggufError, match="different tasks"):
        paired(a, _record([1, 1], ids=[3, 5]))
