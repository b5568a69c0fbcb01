"""Routing by the partition's own clusters: each test document through its cluster's expert alone.

`prepare --partition cluster` grouped the training documents by the tf-idf of their token ids and kept the centres
(data/clusters.safetensors). Here a test document goes to the centre nearest its whole text, as c-BTM routes a
document, and is scored by a model that holds only that cluster's expert. It is the oracle of a cluster MoE: the
expert trained on text like the document, chosen by reading all of it, which no per-token router can. eval's own
oracle (each domain through its one best expert) is weak when a domain is split over many small clusters.

The MoE given is scored on the same documents the same way (every document from an empty KV cache, as
eval/domain_stream.py scores: runtime/perplexity.py document_nll), so the two compare token for token. One model is
alive at a time; each single-expert GGUF is deleted once scored, so the disk holds one at a time whatever N.

Example:
    >>> r = cluster_routed(RunDir("run"), Path("run/eval/models/moe-ridge-top1-f16.gguf"), Path("scratch"), 8192)
    >>> r["routed"]["overall"]["ppl"], r["moe"]["overall"]["ppl"]
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from mfgguf.data.partition import nearest_cluster
from mfgguf.errors import MfggufError
from mfgguf.eval.domain_stream import split_documents
from mfgguf.run import RunDir


def _figures(nll: dict[str, list[np.ndarray]]) -> dict:
    """{domains: {d: ppl, nll (mean nats a token), n_tokens}, overall: the same over every token} from per-document
    NLL arrays."""
    sums = {d: (float(sum(a.sum() for a in arrs)), sum(len(a) for a in arrs)) for d, arrs in nll.items()}
    s, n = sum(v[0] for v in sums.values()), sum(v[1] for v in sums.values())
    fig = lambda s, n: {"ppl": math.exp(s / max(n, 1)), "nll": s / max(n, 1), "n_tokens": n}  # noqa: E731
    return {"domains": {d: fig(*v) for d, v in sums.items()}, "overall": fig(s, n)}


def assign(rd: RunDir, docs: dict[str, list[np.ndarray]], eos: int) -> dict[str, list[int]]:
    """{domain: each document's expert id (1-based)} by the nearest cluster centre of its tokens (EOS left out, as the
    partition read its documents)."""
    from safetensors.numpy import load_file

    if not rd.clusters.is_file():
        raise MfggufError(f"{rd.root} was not prepared with --partition cluster (no {rd.clusters.name}); routing by"
                          " cluster needs its centres")
    cl = load_file(str(rd.clusters))
    return {d: [1 + nearest_cluster(doc[doc != eos], cl["centres"], cl["terms"], cl["idf"]) for doc in ds]
            for d, ds in docs.items()}


def cluster_routed(rd: RunDir, moe: Path, scratch: Path, max_tokens: int, *, ctx: int | None = None,
                   quant: str = "f16", threads: int | None = None) -> dict:
    """Each test document (the first `max_tokens` of each domain) scored by its cluster's expert alone, and by the
    MoE `moe`; single-expert GGUFs are written to `scratch` one at a time. Returns {"routed", "moe": {domains,
    overall}, "experts_used": {d: {expert: documents}}, "documents": n}."""
    from mfgguf.converters.assemble import assemble
    from mfgguf.runtime.perplexity import document_nll

    eos = rd.run_info().eos_id
    docs = {d: split_documents(np.asarray(t), eos) for d, t in rd.test_tokens(max_tokens).items()}
    experts = assign(rd, docs, eos)
    by_expert: dict[int, list[tuple[str, int]]] = {}
    for d, es in experts.items():
        for j, e in enumerate(es):
            by_expert.setdefault(e, []).append((d, j))
    routed = {d: [np.zeros(0)] * len(ds) for d, ds in docs.items()}
    scratch.mkdir(parents=True, exist_ok=True)
    for e, where in sorted(by_expert.items()):
        path = scratch / f"cluster-expert-{e}.gguf"
        assemble(rd.root, path, experts=[e], quant=quant, force=True, progress=False)
        try:
            nll, ctx = document_nll(path, [docs[d][j] for d, j in where], ctx=ctx, threads=threads)
        finally:
            path.unlink(missing_ok=True)
        for (d, j), a in zip(where, nll):
            routed[d][j] = a
    moe_nll = {}
    flat = [(d, j) for d, ds in docs.items() for j in range(len(ds))]
    nll, ctx = document_nll(moe, [docs[d][j] for d, j in flat], ctx=ctx, threads=threads)
    for (d, _), a in zip(flat, nll):
        moe_nll.setdefault(d, []).append(a)
    used = {d: {str(e): es.count(e) for e in sorted(set(es))} for d, es in experts.items()}
    return {"routed": _figures(routed), "moe": _figures(moe_nll), "experts_used": used, "documents": len(flat),
            "ctx": ctx}
