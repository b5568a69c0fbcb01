"""The records a RUN directory holds as JSON, typed: a module's metadata and run.json.

Each record keeps the JSON it was read from (or is to be written as), key order included, so a
record read and written back is byte-identical, and fields this mfgguf does not know survive it
(a later mfgguf may add some). The typed fields are what code reads; `to_json` is what goes to disk,
and the one way a dict goes in is `from_json` (stages that still pass dicts convert at the edge). A record an
earlier mfgguf wrote is read under the current names (legacy.py), and written back with them.

Example:
    >>> m = ModuleMeta.from_json({"format": "mfgguf-module", "version": 2, "name": "trunk", "index": 0})
    >>> m.kind, m.rounds, m.to_json()["name"]
    (None, 1, 'trunk')
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from mfgguf.errors import retired
from mfgguf.run.legacy import OLD_RUN_KEYS, renamed


def module_name(index: int) -> str:
    """0 -> 'trunk', i -> 'expert_00i'."""
    return "trunk" if index == 0 else f"expert_{index:03d}"


def _int(d: dict, key: str, default: int) -> int:
    v = d.get(key)
    return default if v is None else int(v)


def _float(d: dict, key: str, default: float) -> float:
    v = d.get(key)
    return default if v is None else float(v)


@dataclass(frozen=True)
class ModuleMeta:
    """A module's JSON (modules/<name>.json, and the pooled statistics' modules/router_stats.json): what
    `run.write_module` writes and `run.read_module` reads."""

    format: str | None = None  # mfgguf-module (a branch point: its own format)
    version: int | None = None
    name: str | None = None  # trunk, expert_00i, router_stats
    index: int | None = None  # 0 = the trunk, 1..N the experts
    kind: str | None = None  # trunk, expert, router_stats
    preset: str | None = None  # the preset it trained from
    config: dict | None = None  # ModelConfig.to_dict() of the trunk it belongs to
    train: dict = field(default_factory=dict)  # the TrainConfig it trained with (asdict)
    file: str | None = None  # its safetensors file's name inside RUN/modules
    sha256: str | None = None
    blake3: str | None = None
    bytes: int | None = None
    tensors: dict = field(default_factory=dict)  # {GGUF name: shape}, router statistics left out
    trunk_sha256: str | None = None  # experts, pooled statistics: the trunk they belong to
    source: str | None = None  # a trunk: "base" when imported; pooled statistics: "trunk" when from the trunk alone
    validation_loss: dict = field(default_factory=dict)  # {domain: validation loss}
    trunk_validation_loss: dict = field(default_factory=dict)  # experts: the trunk's, on the same tokens
    shard_domains: Any = None  # experts: the domains of their shard, as run.json describes it
    round: int = 1  # experts: the round this file is the end of
    syncs: int = 0  # a trunk: the syncs it has been through
    rounds: int = 1  # experts: the sync rounds R the run trains in
    final: bool = False  # a trunk synced after its last round
    sync: dict | None = None  # a synced trunk: what the sync merged
    synced_from: str | None = None  # a synced trunk: the sha256 of the trunk before the sync
    branch: dict | None = None  # a wsd trunk: its branch point
    tokens_seen: int | None = None  # experts: the tokens they trained on (the merge's weights)
    router_stats_count: int | None = None  # experts: tokens their FFN-input means cover; pooled statistics: G's
    shared_tensors: list = field(default_factory=list)  # experts: trunk tensors they trained private copies of
    shared_merged: bool = False  # experts: a sync already merged those copies into the trunk
    experts: dict = field(default_factory=dict)  # pooled statistics: {expert name: sha256} they were computed with
    validation_loss_mean: float | None = None
    final_loss: float | None = None  # the training loss at its last step
    epochs: float | None = None  # passes over its data its tokens make (older modules lack it)
    precision: str | None = None  # bf16 or fp32: what it trained in
    continued: dict | None = None  # an imported base trained further (a baseline): mode, rank
    restat_tokens: int = 0  # forward-pass tokens a sync's restat spent on it beyond its training
    train_s: float | None = None  # seconds in training steps
    tokens_per_s: float | None = None  # training tokens a second this process trained (its resumed steps left out)
    wall_s: float | None = None  # seconds its stage took
    startup_s: float | None = None  # its process's start before its clock (imports); records older than it lack it
    shard: int | None = None  # experts: the shard they trained on (their index)
    validation_history: list = field(default_factory=list)  # [[step, tokens, {domain: loss}], ...] as it trained
    cooldown_tokens: int | None = None  # a wsd trunk: tokens of its cooldown after its branch point
    streamed: dict | None = None  # a trunk trained streamed: its memory_budget (baselines train under it too)
    planned_flops: float | None = None  # an expert not trained, planned at these FLOPs (eval --budget-flops)
    json: dict = field(default_factory=dict, repr=False, compare=False)  # the record as on disk, in its key order

    @classmethod
    def from_json(cls, d: dict) -> "ModuleMeta":
        d = renamed(d)
        g = d.get
        return cls(format=g("format"), version=g("version"), name=g("name"), index=g("index"), kind=g("kind"), preset=g("preset"), config=g("config"),
                   train=g("train") or {}, file=g("file"), sha256=g("sha256"), blake3=g("blake3"), bytes=g("bytes"),
                   tensors=g("tensors") or {}, trunk_sha256=g("trunk_sha256"), source=g("source"),
                   validation_loss=g("validation_loss") or {}, trunk_validation_loss=g("trunk_validation_loss") or {},
                   shard_domains=g("shard_domains"), round=_int(d, "round", 1), syncs=_int(d, "syncs", 0),
                   rounds=_int(d, "rounds", 1),
                   final=bool(g("final")), sync=g("sync"), synced_from=g("synced_from"), branch=g("branch"),
                   tokens_seen=g("tokens_seen"), router_stats_count=g("router_stats_count"),
                   shared_tensors=list(g("shared_tensors") or []), shared_merged=bool(g("shared_merged")),
                   experts=dict(g("experts") or {}), validation_loss_mean=g("validation_loss_mean"),
                   final_loss=g("final_loss"), epochs=g("epochs"), precision=g("precision"), continued=g("continued"),
                   restat_tokens=_int(d, "restat_tokens", 0), train_s=g("train_s"), tokens_per_s=g("tokens_per_s"),
                   wall_s=g("wall_s"), startup_s=g("startup_s"), shard=g("shard"),
                   validation_history=list(g("validation_history") or []), cooldown_tokens=g("cooldown_tokens"),
                   streamed=g("streamed"), planned_flops=g("planned_flops"), json=dict(d))

    @classmethod
    def of(cls, meta: "ModuleMeta | dict") -> "ModuleMeta":
        """A record, from one or from the dict of a stage that still passes dicts."""
        return meta if isinstance(meta, ModuleMeta) else cls.from_json(meta)

    def to_json(self) -> dict:
        """The record as written to disk (a copy: editing it does not change the record)."""
        return dict(self.json)

    @property
    def eval_tokens(self) -> int:
        """Validation tokens a domain it was scored on at the end of its training (its TrainConfig's)."""
        return int(self.train.get("eval_tokens", 65_536))

    @property
    def schedule(self) -> str:
        """The LR schedule it trained with: cosine or wsd."""
        return self.train.get("schedule", "cosine")

    @property
    def sync_experts(self) -> list[int] | None:
        """The experts the trunk's syncs merged (`sync --experts`), or None where no sync recorded a set."""
        return (self.sync or {}).get("expert_ids")

    def pooled_stale(self, trunk_sha256: str, experts: dict[str, str]) -> str | None:
        """Pooled router statistics: why they do not describe this trunk and these experts ({name: sha256}),
        or None when they do."""
        if self.trunk_sha256 != trunk_sha256:
            return "belong to another version of the trunk"
        if self.source != "trunk":  # an old `router-stats --source trunk` pass holds for any experts
            for name, sha in experts.items():
                if name not in self.experts:
                    return f"cover other experts, not {name}"
                if self.experts[name] != sha:
                    return f"predate {name} (trained since)"
        return None

    def premerge(self) -> dict:
        """What a sync's new statistics replace, kept in the record as "premerge": its scores on its own trunk
        copy and the trunk it trained against."""
        return {k: self.json.get(k) for k in ("validation_loss", "validation_loss_mean", "shard_loss", "trunk_sha256")}

    def finished_against(self, trunk_sha256: str) -> bool:
        """An expert that has trained its last round against this trunk: nothing left to train or sync."""
        return self.trunk_sha256 == trunk_sha256 and self.round >= self.rounds


@dataclass(frozen=True)
class RunInfo:
    """run.json: what `prepare` wrote about the RUN's data, read by `RunDir.run_info`."""

    format: str | None = None
    version: int | None = None
    n_experts: int = 0  # experts the data is partitioned for
    partition: str | None = None  # how documents were split into shards (domain, cluster, ...)
    vocab_size: int | None = None
    eos_id: int | None = None
    token_dtype: str | None = None  # uint16 or uint32
    domains: list = field(default_factory=list)
    shards: Any = None  # one entry per shard (id, docs, tokens, domains)
    train_tokens: int | None = None  # tokens of data/train.npy, the trunk's
    train_docs: int | None = None  # documents left for training after the splits (None: an earlier run.json lacks it)
    test: dict = field(default_factory=dict)  # {domain: {docs, tokens}} of the test split (earlier: "heldout")
    valid: dict = field(default_factory=dict)  # {domain: {docs, tokens}} of the validation split ({}: none)
    sources: list = field(default_factory=list)  # the corpora `prepare` read, as it was given them
    max_chars_per_domain: int | None = None  # `prepare --max-chars-per-domain` (None: no cap)
    seed: int = 0  # `prepare --seed`: the splits and the partition
    test_frac: float = 0.05  # share of each domain's documents in the test split (earlier: "heldout_frac")
    valid_frac: float = 0.0  # share in the validation split (0: a run prepared before it existed)
    json: dict = field(default_factory=dict, repr=False, compare=False)  # the record as on disk, in its key order

    @classmethod
    def from_json(cls, d: dict) -> "RunInfo":
        d = renamed(d, OLD_RUN_KEYS)
        g = d.get
        return cls(format=g("format"), version=g("version"), n_experts=_int(d, "n_experts", 0),
                   partition=g("partition"), vocab_size=g("vocab_size"), eos_id=g("eos_id"),
                   token_dtype=g("token_dtype"), domains=list(g("domains") or []), shards=g("shards"),
                   train_tokens=g("train_tokens"), train_docs=g("train_docs"), test=g("test") or {},
                   valid=g("valid") or {}, sources=list(g("sources") or []),
                   max_chars_per_domain=g("max_chars_per_domain"), seed=_int(d, "seed", 0),
                   test_frac=_float(d, "test_frac", 0.05), valid_frac=_float(d, "valid_frac", 0.0), json=dict(d))

    def to_json(self) -> dict:
        return dict(self.json)

    def shard_domains(self, i: int):
        """Which domains shard i holds, as run.json describes it (None when it does not say)."""
        shards, entry = self.shards, None
        if isinstance(shards, dict):
            entry = shards.get(str(i)) or shards.get(module_name(i)) or shards.get(f"shard_{i:03d}")
        elif isinstance(shards, list) and 0 < i <= len(shards):
            entry = shards[i - 1]
        if isinstance(entry, dict):
            return entry.get("domains", entry)
        return entry


class Untrained(Enum):
    """Why an expert cannot be used with the current trunk; the value completes "expert_00i ..."."""

    MISSING = "is not trained yet"  # no module file: train it
    UNFINISHED = "has not finished training against the current trunk"  # train its next round or sync

    def says(self, name: str) -> str:
        return f"{name} {self.value}"


# Expert options the studies measured not to pay, which mfgguf removed: {train field: (flag, its off value)}
RETIRED_TRAIN = {"complement": ("--complement", False), "expert_layers": ("--expert-layers", "all"),
                 "ffn_rounds": ("--ffn-rounds", 0)}


def check_not_retired(meta: dict, name: str, index: int) -> None:
    """Refuse a module trained with a removed option: nothing here can train it further, assemble or measure it as
    it trained (a complementing expert's learned row, an FFN-only round's merged copies)."""
    train = meta.get("train") or {}
    for key, (flag, off) in RETIRED_TRAIN.items():
        if train.get(key, off) != off or (key == "complement" and meta.get("complement")):
            raise retired(f"module {name} was trained", flag,
                          f"retrain it without it (`mfgguf train-expert RUN --expert {index} --restart`)")


__all__ = ["ModuleMeta", "RunInfo", "Untrained", "module_name", "RETIRED_TRAIN", "check_not_retired"]
