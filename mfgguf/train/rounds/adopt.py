"""The final sync's router statistics from the last round's training steps, instead of a pass.

After the last merge the router needs, for every expert, the mean of the FFN inputs on its shard and
their pooled second moment G. restat.py measures both with a forward pass of merged trunk + that
expert, which made most of the recipe's final sync (docs/benchmarks.md, the recipe's wall). The last
round's steps already measured the same quantities on the way (tailstats.py: means, and for an expert
with shared copies the second moments, written beside the module), on the expert's own trunk copy,
which the merge moves by one round's averaged update. `adopt` takes them: it rewrites the module with
its FFNs and means (its shared copies live in the merged trunk now), records it as an expert of the
final trunk, and pools its moments into G. Its held-out losses stay those of its own trunk copy, and
its record says so. `mfgguf sync --stats-from pass` keeps the pass.

Example:
    >>> m = read_moments(rd, 1, read_module(rd, 1).sha256, cfg.n_layers, cfg.dim)
    >>> adopt(rd, 1, m, pooled)["router_stats_on"]
    'own trunk copy, the last round's training steps'
"""

from __future__ import annotations

import time

from mfgguf.run import SHARED_PREFIX, RunDir, current_trunk, read_module, write_module
from mfgguf.train.engine.weights import read_safetensors
from mfgguf.train.experts.stats import RouterStats

ON = "own trunk copy, the last round's training steps"


def adopt(rd: RunDir, i: int, moments: RouterStats, pooled: RouterStats) -> dict:
    """Expert i as a module of the final trunk with the statistics its last round recorded; `moments` into `pooled`."""
    t0 = time.perf_counter()
    trunk = current_trunk(rd)
    meta = read_module(rd, i)
    tensors = {k: t for k, t in read_safetensors(rd.module_file(i)) if not k.startswith(SHARED_PREFIX)}
    pooled.add(moments)
    out = write_module(rd, i, tensors, {
        **meta.to_json(), "trunk_sha256": trunk.sha256, "shared_merged": True, "router_stats_on": ON,
        "validation_on": "own trunk copy", "restat_tokens": 0,
        "restat_s": time.perf_counter() - t0,
        "premerge": meta.premerge(),
    })
    return out
