"""The questions the stages ask of a RUN's state, answered once: which experts are trained, whether the pooled
router statistics are current for a set of experts (and why not), whether the router-stats pass can run here,
whether the trunk's file is the one the manifest recorded, and whether the RUN is ready to assemble (and what to
run first).

Each answer reads the typed records (records.py) through rundir.py; a reason is a sentence completing
"the pooled router statistics ..." or naming the command that fixes it.

Example:
    >>> rd = RunDir("RUN")
    >>> trained_experts(rd), stats_stale_reason(rd), assemble_blocked(rd)
    ([1, 2, 3], None, None)
"""

from __future__ import annotations

from mfgguf.errors import MfggufError
from mfgguf.run.files import sha256_file
from mfgguf.run.plans import manifest
from mfgguf.run.records import ModuleMeta, module_name
from mfgguf.run.rundir import RunDir, read_json, read_module, untrained_reason


def _experts(rd: RunDir, ids: list[int] | None) -> list[int]:
    return list(range(1, rd.run_info().n_experts + 1)) if ids is None else list(ids)


def module_record(rd: RunDir, index: int) -> ModuleMeta | None:
    """Module `index`'s JSON record as it is (no check of its weights or format: a question of progress, not a
    read of the module), or None where there is none."""
    f = rd.module_meta(index)
    return ModuleMeta.from_json(read_json(f, f"the record of {module_name(index)}")) if f.is_file() else None


def trunk_sha256(rd: RunDir) -> str | None:
    """The current trunk's sha256 (None where no trunk is trained)."""
    return read_module(rd, 0).sha256 if rd.module_meta(0).is_file() else None


def current_trunk(rd: RunDir) -> ModuleMeta:
    """The trunk's record, after checking that no sync is half done and that its file is the one the manifest
    recorded (an expert trained against a modified trunk would fit weights nothing serves)."""
    rd.check_no_pending_sync()
    if not rd.module_file(0).is_file() or not rd.module_meta(0).is_file():
        raise MfggufError(f"the trunk is missing in {rd.modules}; train it first with `mfgguf train-trunk {rd.root}`")
    meta = read_module(rd, 0)
    recorded = manifest(rd).sha256("trunk")
    actual = sha256_file(rd.module_file(0))
    if actual != meta.sha256 or (recorded and actual != recorded):
        raise MfggufError(f"{rd.module_file(0)} does not match its recorded sha256 (modified or damaged);"
                          f" retrain it with `mfgguf train-trunk {rd.root}`")
    return meta


def trained_experts(rd: RunDir, ids: list[int] | None = None) -> list[int]:
    """The experts of `ids` (None: all) that have finished training against the current trunk."""
    sha = trunk_sha256(rd)
    return [] if sha is None else [i for i in _experts(rd, ids) if untrained_reason(rd, sha, i) is None]


def stats_stale_reason(rd: RunDir, ids: list[int] | None = None) -> str | None:
    """Why the pooled router statistics are not current for the trunk and experts `ids` (None: all) as they are
    now ("are missing", "predate expert_002 (trained since)", ...), or None when they are."""
    if not rd.router_stats_meta.is_file() or not rd.module_meta(0).is_file():
        return "are missing"
    experts = {module_name(i): m.sha256 if (m := module_record(rd, i)) else ""  # "": untrained, never current
               for i in _experts(rd, ids)}
    pooled = ModuleMeta.from_json(read_json(rd.router_stats_meta, "the pooled router statistics"))
    trunk = module_record(rd, 0)
    return pooled.pooled_stale(trunk.sha256, experts)


def router_stats_current(rd: RunDir, ids: list[int] | None = None) -> bool:
    """The pooled router statistics were computed on the current trunk and every expert (or experts `ids`) as it
    is now."""
    return stats_stale_reason(rd, ids) is None


def pool_blocked(rd: RunDir, ids: list[int] | None = None) -> str | None:
    """Why the router-stats pass over experts `ids` (None: all) cannot run on this machine (modules or shards
    absent), or None."""
    sha = trunk_sha256(rd)
    for i in _experts(rd, ids):
        if (why := untrained_reason(rd, sha, i)) is not None:
            return why
        if not rd.shard(i).is_file():
            return f"shard {i} (data/{rd.shard(i).name}) is absent"
    return None


def assemble_blocked(rd: RunDir, ids: list[int] | None = None) -> str | None:
    """What to run before the ridge router's assembly of experts `ids` (None: all) can go ahead, or None when the
    RUN is ready (statistics that only need the router-stats pass count as ready: assembly runs it itself)."""
    if trunk_sha256(rd) is None:
        return f"the trunk is not trained: `mfgguf train-trunk {rd.root}` first"
    if stats_stale_reason(rd, ids) is not None and (why := pool_blocked(rd, ids)) is not None:
        return f"{why}: `mfgguf train-expert {rd.root}` (or `mfgguf sync {rd.root}`) first"
    return None


__all__ = ["assemble_blocked", "current_trunk", "module_record", "pool_blocked", "router_stats_current", "stats_stale_reason", "trained_experts",
           "trunk_sha256"]
