"""The RUN's records of what it holds and of its syncs, typed: manifest.json and rounds/sync_<k>/sync.json.

Like records.py's, each keeps the JSON it was read from (key order and unknown keys survive a write back), and a
record an earlier mfgguf wrote is read under the current names (legacy.py).

Example:
    >>> m = Manifest.from_json({"format": "mfgguf-manifest", "modules": {"trunk": {"index": 0, "sha256": "ab"}}})
    >>> m.sha256("trunk"), m.sha256("expert_001")
    ('ab', None)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from mfgguf.run.files import read_json
from mfgguf.run.legacy import renamed
from mfgguf.run.records import ModuleMeta
from mfgguf.run.rundir import RunDir


@dataclass(frozen=True)
class Manifest:
    """manifest.json: every finished module ({name: {index, file, sha256, blake3, bytes, kind, trunk_sha256}}) and
    the pooled router statistics' entry."""

    format: str | None = None
    modules: dict = field(default_factory=dict)  # {module name: its entry}
    router_stats: dict | None = None
    json: dict = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def from_json(cls, d: dict) -> "Manifest":
        d = renamed(d)
        return cls(format=d.get("format"), modules=dict(d.get("modules") or {}), router_stats=d.get("router_stats"),
                   json=dict(d))

    def to_json(self) -> dict:
        return dict(self.json)

    def sha256(self, name: str) -> str | None:
        """The sha256 the manifest records for module `name`, or None where it records none."""
        return (self.modules.get(name) or {}).get("sha256")


@dataclass(frozen=True)
class SyncPlan:
    """rounds/sync_<k>/sync.json: what `mfgguf sync` number `round` merged and the records it publishes."""

    format: str | None = None
    state: str | None = None  # "staged" until every module is published, then "published"
    round: int = 1  # the round whose end this sync merges (1-based)
    rounds: int = 1  # the rounds R the run trains in
    final: bool = False  # the last sync: router statistics for the merged trunk follow
    merge: str | None = None
    merged_tensors: int = 0
    experts: int = 0  # how many took part
    expert_ids: list | None = None  # which (None: every expert of the partition)
    before_validation_loss: dict = field(default_factory=dict)  # the trunk it merged from, scored alike
    modules: dict = field(default_factory=dict)  # {name: ModuleMeta} staged in after/, published on commit
    wall_s: float = 0.0  # every process's time on it, a re-run's added
    startup_s: float = 0.0
    json: dict = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def from_json(cls, d: dict) -> "SyncPlan":
        d = renamed(d)
        g = d.get
        return cls(format=g("format"), state=g("state"), round=int(g("round") or 1), rounds=int(g("rounds") or 1),
                   final=bool(g("final")), merge=g("merge"), merged_tensors=int(g("merged_tensors") or 0),
                   experts=int(g("experts") or 0), expert_ids=g("expert_ids"),
                   before_validation_loss=g("before_validation_loss") or {},
                   modules={k: ModuleMeta.from_json(v) for k, v in (g("modules") or {}).items()},
                   wall_s=float(g("wall_s") or 0.0), startup_s=float(g("startup_s") or 0.0), json=dict(d))

    def to_json(self) -> dict:
        return dict(self.json)

    @property
    def ids(self) -> list[int]:
        """The experts that took part."""
        return list(self.expert_ids or range(1, self.experts + 1))

    @property
    def published(self) -> bool:
        return self.state == "published"


def manifest(run: RunDir) -> Manifest:
    """The RUN's manifest, typed; a one-line error where there is none yet."""
    return Manifest.from_json(read_json(run.manifest, "the run manifest (train the trunk first)"))


def sync_plan(path: Path) -> SyncPlan:
    """A sync's plan (rounds/sync_<k>/sync.json), typed."""
    return SyncPlan.from_json(read_json(path, "the sync plan"))


__all__ = ["Manifest", "SyncPlan", "manifest", "sync_plan"]
