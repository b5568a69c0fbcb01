"""The per-domain LoRA alternative: one adapter per expert's shard, FLOP-matched, applied by llama.cpp per domain."""

from __future__ import annotations

import shutil

import numpy as np

from mfgguf.eval.baselines.imported import train_domain_loras
from mfgguf.eval.domain_loras import measure_domain_loras
from mfgguf.flops import module_flops
from mfgguf.run import RunDir, read_module, read_module_meta
from mfgguf.runtime.perplexity import perplexity
from tests.train.whole.test_continued import base_run, cli  # noqa: F401  (the module-scoped fixture)


def test_one_adapter_per_shard_flop_matched_and_scored_with_its_domain(base_run, tmp_path):  # noqa: F811
    run = tmp_path / "run"
    shutil.copytree(base_run, run, symlinks=True)
    for i in (1, 2):
        r = cli("train-expert", run, "--expert", i, "--tokens", 4096, "--eval-tokens", 512, "--no-progress")
        assert r.exit_code == 0, r.output
    rd = RunDir(run)
    metas = {i: read_module(rd, i) for i in (0, 1, 2)}
    adapters = train_domain_loras(rd, metas, tmp_path / "out", lr=1e-2)
    assert [a.shard for a in adapters] == [1, 2] and all(a.adapter.is_file() for a in adapters)
    for a in adapters:  # each adapter spent its expert's FLOPs, within half an optimizer step
        meta = read_module_meta(RunDir(a.run), 0, weights_kept=False)  # an adapter keeps no merged trunk
        assert meta["continued"]["shards"] == [a.shard]
        per_tok = module_flops(meta) / meta["tokens_seen"]
        assert abs(module_flops(meta) - module_flops(metas[a.shard])) <= per_tok * 16 * 256 / 2
    base = tmp_path / "base.gguf"
    assert cli("assemble", run, "-o", base, "--experts", "none", "--quant", "f32", "-q").exit_code == 0
    domains = sorted(d for a in adapters for d in a.domains)
    r = measure_domain_loras(base, adapters, rd, domains, max_tokens=1024, ctx=64, split="validation")
    assert set(r["domains"]) == set(domains) and np.isfinite(r["overall"]["ppl"])
    held = rd.validation_tokens(1024)
    for a in adapters:  # its own domain gets its adapter, and the adapter helps there
        for d in a.domains:
            assert r["domains"][d]["adapter"] == a.run.name
            assert r["domains"][d]["ppl"] < perplexity(base, np.asarray(held[d]), ctx=64)["ppl"]


def test_on_clusters_each_domain_goes_to_the_cluster_holding_most_of_it_and_every_adapter_is_a_candidate(tmp_path):
    """A cluster shard holds several domains (run.json counts each one's tokens): the client that knows the domain picks
    the cluster with most of it, and the stream, which does not know it, chooses among every cluster's adapter."""
    from mfgguf.eval.domain_loras import DomainAdapter, domain_owners
    from mfgguf.eval.domain_stream import BASE, stream_candidates

    runs = [tmp_path / f"lora-shard{i}" for i in (1, 2, 3)]
    a1 = DomainAdapter(1, ("c", "python", "man"), 100, 1e-3, runs[0], (600, 400, 10))
    a2 = DomainAdapter(2, ("c", "english"), 100, 1e-3, runs[1], (20, 500))
    a3 = DomainAdapter(3, ("man", "python", "c"), 100, 1e-3, runs[2], (300, 100, 5))  # holds no domain's majority of c
    owners = domain_owners([a1, a2, a3])
    assert {d: a.shard for d, a in owners.items()} == {"c": 1, "python": 1, "man": 3, "english": 2}
    label = [DomainAdapter(1, ("c",), 1, 1e-3, runs[0]), DomainAdapter(2, ("python",), 1, 1e-3, runs[1])]
    assert {d: a.shard for d, a in domain_owners(label).items()} == {"c": 1, "python": 2}  # a label shard: its own domain
    only_one = {"c": str(a1.adapter), "python": str(a1.adapter)}  # every domain owned by one cluster
    cands, own = stream_candidates(only_one, [str(a.adapter) for a in (a1, a2, a3)])
    assert list(cands) == [BASE, "lora-shard1", "lora-shard2", "lora-shard3"]
    assert own == {"c": "lora-shard1", "python": "lora-shard1"}
