"""Which side's baselines a RUN gets, and what `--baselines` may name across both sides.

A RUN's trunk decides the side: trained here, dense models from scratch; imported, the base
trained further. `--baselines` is parsed before the RUN is read, so it accepts either side's keys;
each side then trains the ones that are its own.

Example:
    >>> side_for(read_module(rd, 0)).kinds
    >>> parse_baselines("flop,lora")
"""

from __future__ import annotations

from mfgguf.errors import MfggufError
from mfgguf.eval.baselines.baseline import Side, keys
from mfgguf.eval.baselines.imported import Imported
from mfgguf.eval.baselines.scratch import Scratch
from mfgguf.run import ModuleMeta

SIDES: dict[bool, Side] = {False: Scratch(), True: Imported()}  # by "is the trunk an imported base"


def side_for(trunk: ModuleMeta) -> Side:
    """The side of the trunk whose module record is `trunk`."""
    return SIDES[trunk.source == "base"]


def parse_baselines(spec: str) -> tuple[str, ...] | None:
    """'flop,wallclock,total' -> a tuple; 'auto' -> None (each side's default set); 'none' or '' -> ()."""
    spec = spec.strip().lower()
    if spec == "auto":
        return None
    scratch = keys(SIDES[False].kinds)
    imported = [k for k in keys(SIDES[True].kinds) if k not in scratch]
    keys_ = tuple(k.strip() for k in spec.split(",") if k.strip() and k.strip() != "none")
    bad = [k for k in keys_ if k not in (*scratch, *imported)]
    if bad:
        raise MfggufError(f"unknown baseline {bad[0]!r}; choose from {', '.join(scratch)} (comma-separated),"
                          f" {', '.join(imported)} (an imported base), auto or none")
    return keys_


__all__ = ["SIDES", "side_for", "parse_baselines"]
