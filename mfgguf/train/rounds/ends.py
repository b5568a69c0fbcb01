"""Rounds of a run: R rounds of local training split one `steps`-step schedule, a sync after each.

Example:
    >>> [round_end(1000, 4, r) for r in (1, 2, 3, 4)]
    [250, 500, 750, 1000]
"""

from __future__ import annotations


def round_end(steps: int, rounds: int, r: int) -> int:
    """The schedule step at which round r (1..rounds) of a `steps`-step run ends."""
    return steps * r // rounds
