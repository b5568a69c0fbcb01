"""The pooled router statistics assembly reads, checked against the manifest and the modules they were computed with.

The other module files (trunk, experts) are read and checked by mfgguf/modules/module.py; where the pooled
statistics are missing or stale, assembly runs the router-stats pass first (ensure_stats.py).
"""

from __future__ import annotations

import json

from mfgguf.errors import MfggufError
from mfgguf.run import RunDir, router_stats_stale
from mfgguf.run.records import ModuleMeta
from mfgguf.modules.module import Module, read_header


class PooledStatsNeeded(MfggufError):
    """The pooled router statistics are missing or stale: the router-stats pass would fix it (ensure_stats.py)."""

    def __init__(self, message: str, why: str):
        super().__init__(message)
        self.why = why  # "are missing", or router_stats_stale's reason


def load_pooled_stats(run: RunDir, manifest: dict, trunk: Module, experts: list[Module]) -> Module:
    """The pooled router statistics (train/experts/pooled.py) of this trunk and these experts, checked against the manifest."""
    redo = f"compute them with `mfgguf router-stats {run.root}`"
    if not run.router_stats_meta.is_file() or not run.router_stats.is_file():
        raise PooledStatsNeeded(f"{run.root} has no pooled router statistics (modules/{run.router_stats.name}); {redo}",
                                "are missing")
    meta = ModuleMeta.from_json(json.loads(run.router_stats_meta.read_text()))
    rec = manifest.get("router_stats") or {}
    if rec.get("blake3") != meta.blake3 or not meta.blake3:
        raise MfggufError(f"the pooled router statistics' metadata differs from the manifest's; {redo}")
    if why := router_stats_stale(meta, trunk.meta.sha256, {m.name: m.meta.sha256 for m in experts}):
        raise PooledStatsNeeded(f"the pooled router statistics {why}; {redo}", why)
    st = run.router_stats.stat()
    if st.st_size != meta.bytes:
        raise MfggufError(f"{run.router_stats.name} is {st.st_size} bytes, {meta.bytes} were recorded: modified"
                          f" or truncated; {redo}")
    header_len, entries = read_header(run.router_stats, "the pooled router statistics")
    return Module(-1, "router_stats", run.router_stats, meta, entries, header_len, st.st_size, st.st_mtime_ns)
