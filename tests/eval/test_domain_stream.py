"""Per-domain LoRAs with the domain unknown: each document served by the candidate of lowest loss on its opening.

A tiny imported llama base (tests/train/whole/test_continued.py), one LoRA adapter per shard trained by
`train-base --mode lora`, its dense GGUF, and llama.cpp scoring documents. The built-in corpus's held-out
splits hold two or three long documents a domain, so most tests cut each domain's held-out tokens into
documents of cycling lengths (some shorter than the opening chosen on, some several windows long). The
references are llama.cpp's full logits (logits_all) reduced in numpy, one window at a time.

Not tested: that documents pick their own domain's adapter. On this random base, LoRAs of 4,096 (or
16,384) tokens move the openings' losses by about 1%, and a third to two thirds of a domain's
documents pick their own: no reliable test at this size.
"""

from __future__ import annotations

import numpy as np
import pytest

from mfgguf.errors import MfggufError
from mfgguf.eval.domain_loras import DomainAdapter, measure_domain_loras
from mfgguf.eval.domain_stream import BASE, domain_stream, split_documents
from mfgguf.run import RunDir
from mfgguf.runtime.llm import loaded
from mfgguf.runtime.perplexity import document_windows
from tests.train.whole.test_continued import base_run, cli  # noqa: F401  (the module-scoped fixture)

CTX = 32  # windows: documents of this corpus run to hundreds of tokens, so most take several
CHOOSE = 16  # the opening each document is chosen on (the measurement's default is 128)
CAP = 1024  # held-out tokens a domain
# llama.cpp runs on one thread here: this tiny model's many small windows, each a barrier per op across threads,
# slow down tenfold when the machine's other work takes a core
LENGTHS = (40, 9, 100, 23, 70)  # documents cut from them, in turn: shorter than CHOOSE and longer than CTX


@pytest.fixture(scope="module")
def served(base_run, tmp_path_factory):  # noqa: F811
    """(RUN, base GGUF, {candidate: adapter or None}, {domain: its own candidate}, {domain: held-out tokens cut into
    documents}, EOS id)."""
    d = tmp_path_factory.mktemp("stream")
    rd = RunDir(base_run)
    info = rd.run_info()
    candidates, own = {BASE: None}, {}
    for shard in info.shards:
        out = d / f"lora-shard{shard['id']}"
        r = cli("train-base", base_run, "-o", out, "--mode", "lora", "--shards", shard["id"], "--tokens", 4096,
                "--lr", 1e-2, "--rank", 4, "--no-progress")
        assert r.exit_code == 0, r.output
        candidates[out.name] = out / "lora.gguf"
        own.update({dom: out.name for dom in shard["domains"]})
    base = d / "base.gguf"
    assert cli("assemble", base_run, "-o", base, "--experts", "none", "--quant", "f32", "-q").exit_code == 0
    eos = int(info.eos_id)
    test = rd.test_tokens()
    held = {k: np.concatenate([np.asarray(v), np.asarray(test.get(k, v[:0]))]) for k, v in rd.validation_tokens().items()}
    toks = {}
    for k, t in held.items():  # its text without its EOS, cut into documents of LENGTHS in turn, each closed by EOS
        t, cut, i = t[t != eos][:CAP], [], 0
        while t.size:
            cut += [t[: LENGTHS[i % len(LENGTHS)]], [eos]]
            t, i = t[LENGTHS[i % len(LENGTHS)]:], i + 1
        toks[k] = np.concatenate(cut).astype(np.int64)  # (CAP + documents,)
    return rd, base, candidates, own, toks, eos


@pytest.fixture(scope="module")
def stream(served):
    rd, base, candidates, own, toks, eos = served
    return domain_stream(base, toks, candidates, eos=eos, own=own, choose_tokens=CHOOSE, ctx=CTX, threads=1)


def _log_softmax(x: np.ndarray) -> np.ndarray:  # (T, V) float64
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def _reference_nll(base, lora, docs: list[np.ndarray], first: int | None = None) -> list[np.ndarray]:
    """Each document's per-token NLL from llama.cpp's logits at every position of each of its windows."""
    out = []
    with loaded(base, n_ctx=CTX, logits_all=True, lora=lora, threads=1, flash_attn=True) as llm:  # as scoring opens it
        bos = llm.token_bos() if llm._model.add_bos_token() else None
        for doc in docs:
            doc = doc[: first + 1] if first is not None else doc
            nll = np.full(len(doc) - 1, np.nan)  # (n - 1,)
            for s, e, f in document_windows(len(doc), CTX):
                ids = doc[s:e].tolist()
                if bos is not None:
                    ids[0] = bos
                llm.reset()
                llm.eval(ids)
                logp = _log_softmax(np.array(llm.scores[: e - s], dtype=np.float64))  # (e - s, V)
                pos = np.arange(f, e - 1)  # scored positions of the document, predicting pos + 1
                nll[pos] = -logp[pos - s, doc[pos + 1]]
            out.append(nll)
    return out


def _docs(toks: dict, eos: int) -> list[np.ndarray]:
    return [u for t in toks.values() for u in split_documents(t, eos)]


def test_documents_are_split_at_eos_and_cover_the_split_once(served):
    *_, toks, eos = served
    for t in toks.values():
        units = split_documents(t, eos)
        assert len(units) > 2 and all(u[0] == eos for u in units)
        assert np.array_equal(np.concatenate([u[1:] for u in units]), t)  # every token scored once, in order
        assert all(eos not in u[1:-1] for u in units)  # no document sees another


def test_windows_score_every_token_once_with_half_a_window_of_context():
    for ctx in (3, 4, 5, 32):
        for n in range(1, 200):
            spans, scored = document_windows(n, ctx), []
            for s, e, f in spans:
                assert e - s <= ctx and (f == 0 if s == 0 else f - s == ctx // 2)
                scored += range(f, e - 1)
            assert scored == list(range(n - 1)), (n, ctx)
    with pytest.raises(MfggufError, match="too small"):
        document_windows(10, 2)


def test_each_document_takes_the_candidate_of_lowest_loss_on_its_opening(served, stream):
    rd, base, candidates, own, toks, eos = served
    docs = _docs(toks, eos)
    assert [d["chosen"] for d in stream["documents"]] and len(stream["documents"]) == len(docs)
    ref = {c: [a.sum() for a in _reference_nll(base, lora, docs, first=CHOOSE)] for c, lora in candidates.items()}
    names = list(candidates)
    for i, d in enumerate(stream["documents"]):
        mine = np.array([ref[c][i] for c in names])  # (candidates,)
        assert [d["choice_nll"][c] for c in names] == pytest.approx(mine, rel=1e-5, abs=1e-5)
        assert mine[names.index(d["chosen"])] <= mine.min() + 1e-4  # the lowest, up to float noise between kernels
    picked = {c: sum(n.get(c, 0) for n in stream["choice"].values()) for c in names}
    print(f"documents per candidate {picked}, own share {stream['own_choice']}")
    assert sum(picked.values()) == len(docs)


def test_one_candidate_is_that_model_on_every_document(served, stream):
    rd, base, candidates, own, toks, eos = served
    r = domain_stream(base, toks, {BASE: None}, eos=eos, choose_tokens=CHOOSE, ctx=CTX, threads=1)
    docs = _docs(toks, eos)
    ref = _reference_nll(base, None, docs)
    assert r["overall"]["n_tokens"] == sum(len(t) for t in toks.values()) == sum(len(a) for a in ref)
    assert r["overall"]["nll"] == pytest.approx(sum(a.sum() for a in ref) / sum(len(a) for a in ref), rel=1e-5)
    after = [a[CHOOSE:] for a in ref]
    assert r["after_choice"]["n_tokens"] == sum(len(a) for a in after)
    assert r["after_choice"]["nll"] == pytest.approx(sum(a.sum() for a in after) / sum(len(a) for a in after), rel=1e-5)
    assert all(set(c) == {BASE} for c in r["choice"].values()) and "own_choice" not in r
    # the stream of several candidates is, document by document, what its chosen candidate alone scores there
    alone = {c: r if lora is None else domain_stream(base, toks, {c: lora}, eos=eos, choose_tokens=CHOOSE, ctx=CTX,
                                                     threads=1) for c, lora in candidates.items()}
    picked = [alone[d["chosen"]]["documents"][i] for i, d in enumerate(stream["documents"])]
    assert sum(d["n_tokens"] for d in picked) == stream["overall"]["n_tokens"]
    assert sum(d["nll"] for d in picked) / stream["overall"]["n_tokens"] == pytest.approx(stream["overall"]["nll"], rel=1e-6)
    for dom, v in stream["domains"].items():
        assert v["documents"] == sum(stream["choice"][dom].values())


def test_measure_domain_loras_reports_the_stream_beside_the_oracle(served):
    """The RUN's own validation split through eval's measuring process, as in-process on the same tokens."""
    rd, base, candidates, own, _, eos = served
    adapters = [DomainAdapter(int(c.split("shard")[1]), tuple(d for d, o in own.items() if o == c), 4096, 1e-2,
                              candidates[c].parent) for c in candidates if c != BASE]
    toks = rd.validation_tokens(CAP // 4)
    r = measure_domain_loras(base, adapters, rd, list(toks), max_tokens=CAP // 4, ctx=CTX, split="validation",
                             stream=True, choose_tokens=CHOOSE)
    s = r["stream"]
    here = domain_stream(base, toks, candidates, eos=eos, own=own, choose_tokens=CHOOSE, ctx=CTX, threads=1)
    assert s["candidates"] == list(candidates) and "documents" not in s and s["peak_rss_mb"] > 0
    for part in ("overall", "after_choice"):
        assert s[part]["ppl"] == pytest.approx(here[part]["ppl"], rel=1e-6)
    assert s["choice"] == here["choice"] and s["own_choice"] == here["own_choice"]
    assert s["overall"]["n_tokens"] == sum(len(t) for t in toks.values())  # every token, where the oracle scores half
    assert set(r["domains"]) == set(toks) and r["domains"]["english"]["adapter"] == "lora-shard2"


def test_a_tie_goes_to_the_earlier_candidate(served):
    rd, base, candidates, own, toks, eos = served
    c = toks["c"][:300]
    r = domain_stream(base, {"c": c}, {BASE: None, "again": None}, eos=eos, choose_tokens=CHOOSE, ctx=CTX, threads=1)
    assert r["choice"] == {"c": {BASE: len(split_documents(c, eos)), "again": 0}}
    with pytest.raises(MfggufError, match="reads nothing"):
        domain_stream(base, toks, {BASE: None}, eos=eos, choose_tokens=0)
