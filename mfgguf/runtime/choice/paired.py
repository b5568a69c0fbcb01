"""Two models' benchmark verdicts on the same tasks, compared task by task.

A difference in accuracy between two models scored on the same tasks is measured far more tightly paired than by
their two intervals apart: most tasks both get right or both get wrong, and only the tasks one of them alone gets
right move the difference. `paired` gives the difference in points with an interval (LEVEL) from a paired bootstrap
over the tasks (each draw resamples tasks, both models' verdicts together), the discordant counts, and the exact
McNemar p-value (a two-sided binomial test on those counts).

Example:
    >>> paired({"task_ids": [0, 1, 2], "right": [1, 1, 0]}, {"task_ids": [2, 0, 1], "right": [0, 1, 0]})["points"]
    33.33333333333333
"""

from __future__ import annotations

import math

import numpy as np

from mfgguf.errors import MfggufError

DRAWS = 10_000  # bootstrap resamples of the tasks
CHUNK = 500  # resamples drawn at a time (memory: CHUNK x tasks indices)
LEVEL = 0.95


def verdicts_by_task(record: dict) -> dict[int, int]:
    return dict(zip(map(int, record["task_ids"]), map(int, record["right"])))


def paired(a: dict, b: dict, *, draws: int = DRAWS, seed: int = 0) -> dict:
    """A's accuracy minus B's, in points, over the tasks both scored (the same set, or one line saying so)."""
    va, vb = verdicts_by_task(a), verdicts_by_task(b)
    if set(va) != set(vb):
        raise MfggufError(f"the two results scored different tasks ({len(va)} and {len(vb)}, {len(set(va) & set(vb))}"
                          " in common); score both with the same file and task count")
    ids = sorted(va)
    x = np.array([va[i] for i in ids], dtype=np.float64)  # (n,)
    y = np.array([vb[i] for i in ids], dtype=np.float64)  # (n,)
    n = len(ids)
    rng, diffs = np.random.default_rng(seed), []
    for k in range(0, draws, CHUNK):
        idx = rng.integers(0, n, size=(min(CHUNK, draws - k), n))  # (draws, n) tasks drawn with replacement
        diffs.append(x[idx].mean(axis=1) - y[idx].mean(axis=1))
    d = np.concatenate(diffs) * 100  # (draws,) points
    only_a, only_b = int(((x == 1) & (y == 0)).sum()), int(((x == 0) & (y == 1)).sum())
    lo, hi = np.percentile(d, [100 * (1 - LEVEL) / 2, 100 * (1 + LEVEL) / 2])
    return {"points": float((x.mean() - y.mean()) * 100), "low": float(lo), "high": float(hi), "tasks": n,
            "only_a": only_a, "only_b": only_b, "mcnemar_p": mcnemar(only_a, only_b), "draws": draws}


def mcnemar(only_a: int, only_b: int) -> float:
    """The exact two-sided McNemar p-value: how likely a split of the discordant tasks this uneven is by chance."""
    n = only_a + only_b
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, k) for k in range(min(only_a, only_b) + 1)) / 2.0 ** n
    return min(1.0, 2 * tail)


__all__ = ["mcnemar", "paired", "verdicts_by_task"]
