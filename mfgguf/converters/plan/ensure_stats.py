"""Assembly runs the router-stats pass itself when the pooled router statistics are missing or stale.

The ridge router needs the second moment of the FFN inputs pooled over every expert's shard
(train/experts/pooled.py). `train-experts` and `sync` write it, but a run whose experts were trained one
by one with `train-expert` has none, and retraining one expert makes it stale. Then `assemble` and
`extend --add` compute it first (one line on stderr says so; the pass shows its progress bar when progress
is on), as `mfgguf router-stats RUN` would, whether they are called by the CLI or as library functions.
The pass sits on the training floor below this one; it is imported only when it runs (torch).
Where the pass cannot run on this machine (an expert not trained here, or a shard absent), the planner's
error stands, with the reason appended.

Example:
    >>> p = plan_with_stats(lambda: plan(rd, ...), rd, progress=True)
"""

from __future__ import annotations

import sys
from typing import Callable, TypeVar

from mfgguf.errors import MfggufError
from mfgguf.run import RunDir
from mfgguf.run.state import pool_blocked
from mfgguf.converters.plan.modules import PooledStatsNeeded

T = TypeVar("T")


def plan_with_stats(make_plan: Callable[[], T], rd: RunDir, *, progress: bool, verb: str = "assemble",
                    experts: list[int] | None = None) -> T:
    """`make_plan()`; where it stops for missing or stale pooled statistics, run the pass and plan again.

    `experts` are the ones the plan takes (None: every expert of the run): the pass pools over
    those only, so a run whose other experts are not trained yet still assembles the trained ones."""
    try:
        return make_plan()
    except PooledStatsNeeded as e:
        if (blocked := pool_blocked(rd, experts)) is not None:
            raise MfggufError(f"{e} ({verb} cannot compute them here: {blocked})") from None
        some = "" if experts is None else " --experts " + ",".join(map(str, experts))
        print(f"{verb}: the pooled router statistics {e.why}; computing them first (`mfgguf router-stats"
              f" {rd.root}{some}`)", file=sys.stderr, flush=True)
        from mfgguf.train.experts.pooled import pool_router_stats  # torch: only when the pass runs

        pool_router_stats(rd.root, progress=progress, experts=experts)
    return make_plan()
