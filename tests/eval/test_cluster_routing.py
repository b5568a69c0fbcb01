"""Routing by the partition's clusters: each test document through its cluster's expert alone, the MoE on the same
documents. The session's tiny trained RUN (label partition, one expert a built-in domain) gets the centres a cluster
partition of its own training documents makes, as `prepare --partition cluster` would write them."""

from __future__ import annotations

import math

import numpy as np
import pytest

from mfgguf.converters.assemble import assemble
from mfgguf.data.partition import partition_cluster
from mfgguf.data.prepare import _save_clusters
from mfgguf.errors import MfggufError
from mfgguf.eval.cluster_routing import assign, cluster_routed
from mfgguf.eval.domain_stream import BASE, domain_stream, split_documents
from mfgguf.run import RunDir
from tests.conftest import copy_run

CAP, CTX = 2048, 64  # test tokens a domain; windows short enough that long documents take several


@pytest.fixture(scope="module")
def clustered(trained_run, tmp_path_factory):
    """(RUN copy with data/clusters.safetensors from its training documents, its f32 MoE GGUF)."""
    root = copy_run(trained_run, tmp_path_factory.mktemp("clustered") / "run")
    rd = RunDir(root)
    eos = rd.run_info().eos_id
    docs, domains = [], []
    for s in rd.info()["shards"]:
        t = np.load(rd.shard(int(s["id"])))
        ends = np.flatnonzero(t == eos)  # each document is followed by its EOS
        for a, b in zip(np.concatenate([[0], ends + 1]), np.concatenate([ends, [len(t)]])):
            if b > a:
                docs.append(t[a:b])
                domains.append(max(s["domains"], key=s["domains"].get))
    _save_clusters(rd.clusters, partition_cluster(docs, 3, domains=domains, seed=0))
    moe = root.parent / "moe.gguf"
    assemble(root, moe, quant="f32", progress=False)
    return rd, moe


def test_routed_and_moe_score_every_test_token_once(clustered, tmp_path):
    rd, moe = clustered
    r = cluster_routed(rd, moe, tmp_path / "scratch", CAP, ctx=CTX, quant="f32", threads=1)
    eos = rd.run_info().eos_id
    held = rd.test_tokens(CAP)
    for d, t in held.items():
        want = sum(len(doc) - 1 for doc in split_documents(np.asarray(t), eos))  # each token once, its first is context
        assert r["routed"]["domains"][d]["n_tokens"] == want == r["moe"]["domains"][d]["n_tokens"]
    assert not list((tmp_path / "scratch").glob("*.gguf"))  # each single-expert file deleted once scored
    # the MoE as domain_stream scores one candidate: the same documents, the same windows, the same figure
    ref = domain_stream(moe, {d: np.asarray(t) for d, t in held.items()}, {BASE: None}, eos=eos, ctx=CTX, threads=1)
    assert math.isclose(r["moe"]["overall"]["nll"], ref["overall"]["nll"], rel_tol=1e-9)
    assert r["routed"]["overall"]["ppl"] != r["moe"]["overall"]["ppl"]
    assert sum(sum(v.values()) for v in r["experts_used"].values()) == r["documents"]


def test_documents_go_to_the_cluster_of_their_domain(clustered):
    rd, _ = clustered
    eos = rd.run_info().eos_id
    docs = {d: split_documents(np.asarray(t), eos) for d, t in rd.test_tokens().items()}
    got = assign(rd, docs, eos)
    firsts = {d: max(set(es), key=es.count) for d, es in got.items()}
    assert len(set(firsts.values())) == len(firsts), got  # each domain's documents mostly in a cluster of their own
    share = sum(es.count(firsts[d]) for d, es in got.items()) / sum(len(es) for es in got.values())
    assert share > 0.8, got


def test_a_label_partition_has_no_clusters_to_route_by(trained_run, tmp_path):
    with pytest.raises(MfggufError, match="--partition cluster"):
        cluster_routed(RunDir(trained_run), tmp_path / "none.gguf", tmp_path, CAP)
