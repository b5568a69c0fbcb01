"""The one interface every baseline of `mfgguf eval` meets, whichever side it comes from.

A baseline is what a practitioner would have done with the same data and compute instead of
training experts. Which alternatives make sense depends on where the trunk came from, so there are
two sides, each a table of kinds and one `train`:
  - from scratch (eval/baselines/scratch.py): dense models trained like the trunk, on a trunk
    trained by this RUN;
  - an imported base (eval/baselines/imported.py): the base itself trained further, continued
    pretraining and LoRA, since its own pretraining counts for nobody.
Evaluate asks the side for its baselines trained (`Side.train`) and gets back records (`Trained`)
that carry everything the report needs, so it assembles, measures and reports them all alike.

Example:
    >>> outcome = side_for(metas[0]).train(Job(rd, metas, out, which=None, force=False, schedules=("cosine",)))
    >>> [(t.label, t.gguf) for t in outcome.trained]
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from mfgguf.run import ModuleMeta, RunDir

SECTIONS = {"base_baselines": None, "dense_schedules": {}}  # report.json's per-side sections, as when empty


@dataclass(frozen=True)
class Kind:
    """One row of a side's table: what `--baselines` names, how it is budgeted and trained, its report row."""

    key: str  # what --baselines names (report.json's goals: moe_over_<key>_dense_mixed)
    label: str  # the report's row name
    budget: str  # what it is matched on: a run_flops total (scratch) or flops / seconds (imported)
    trains: str  # how: the FFN width it gets (scratch: active, total) or what trains (imported: full, lora)


@dataclass(frozen=True)
class Job:
    """What a side needs to train its baselines."""

    rd: RunDir
    metas: dict[int, ModuleMeta]  # {0: the trunk's record, i: expert i's}: the experts in the MoE
    out: Path  # the eval directory: each baseline's RUN lives under it
    which: tuple[str, ...] | None  # the keys asked for (a side ignores the other side's); None: its default set
    force: bool  # retrain even where a matching baseline exists
    schedules: tuple[str, ...] | None  # LR schedules a dense model trains with; None: no dense training asked for
    seed: int | None = None  # every baseline training's seed; None: each side's default (the trunk's, the preset's)
    lrs: dict[str, tuple[float, ...]] | None = None  # an imported base's LR grid per mode (full, lora); None: GRID's


@dataclass(frozen=True)
class Trained:
    """A trained baseline as the report sees it."""

    key: str  # its kind's key
    label: str  # its row name
    run: Path  # the RUN whose trunk is the baseline: assembled alone, no experts
    gguf: str  # its GGUF's name, before the quant type
    row: dict  # report.json's models[label], besides file and bytes
    flops: dict  # report.json's flops.models[label]


@dataclass(frozen=True)
class Outcome:
    """A side's baselines trained, and what of them the report shows beyond a row each."""

    trained: list[Trained] = field(default_factory=list)
    curves: dict[str, ModuleMeta] = field(default_factory=dict)  # label -> the record whose held-out curve is drawn
    sections: dict = field(default_factory=dict)  # report.json sections of this side (keys of SECTIONS)


class Side(Protocol):
    kinds: tuple[Kind, ...]

    def train(self, job: Job) -> Outcome: ...


def keys(kinds: tuple[Kind, ...]) -> tuple[str, ...]:
    return tuple(k.key for k in kinds)


__all__ = ["SECTIONS", "Kind", "Job", "Trained", "Outcome", "Side", "keys"]
