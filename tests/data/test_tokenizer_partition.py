"""Tokenizer (real stdlib text) and the three partitions plus the held-out split."""

from __future__ import annotations

import json
import sysconfig
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from mfgguf.data.partition import (_tfidf, composition, nearest_cluster, partition, partition_cluster, partition_label,
                                   partition_random, draw_split)
from mfgguf.data.sources import load_documents
from mfgguf.data.tokenizer import (EOS_ID, EOS_TOKEN, encode_documents, load_tokenizer, token_dtype,
                                   train_tokenizer)
from mfgguf.errors import MfggufError

STDLIB = Path(sysconfig.get_paths()["stdlib"])


@pytest.fixture(scope="module")
def corpus():
    """Built-in documents (150k chars per domain), a 512-token BPE, and their token ids."""
    docs = load_documents(["builtin"], max_chars_per_domain=150_000, progress=False)
    tok = train_tokenizer([d.text for d in docs], 512)
    ids = list(encode_documents(tok, [d.text for d in docs]))
    return docs, tok, ids


# ---- tokenizer ---------------------------------------------------------------------------------------


def test_tokenizer_round_trips_real_text_and_has_eos_zero(corpus, tmp_path):
    _, tok, _ = corpus
    assert tok.token_to_id(EOS_TOKEN) == EOS_ID == 0
    assert tok.get_vocab_size() == 512
    unseen = (STDLIB / "difflib.py").read_text() + "\nnaïve café — 日本語 🙂\ttabs\r\n"
    ids = tok.encode(unseen).ids
    assert tok.decode(ids) == unseen
    assert len(ids) < len(unseen.encode()) * 0.6  # the merges compress real code
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    spec = json.loads(path.read_text())
    assert spec["normalizer"] is None
    assert spec["pre_tokenizer"]["type"] == "ByteLevel" and spec["pre_tokenizer"]["add_prefix_space"] is False
    assert spec["decoder"]["type"] == "ByteLevel"
    assert spec["model"]["type"] == "BPE"
    back = load_tokenizer(path)
    assert back.encode(unseen).ids == ids


def test_encode_documents_batches_and_treats_literal_eos_as_text(corpus):
    _, tok, ids = corpus
    texts = ["x = 1\n", f"a {EOS_TOKEN} b", ""]
    out = list(encode_documents(tok, texts, batch=2, dtype=np.uint16))
    assert [a.dtype for a in out] == [np.uint16] * 3
    assert EOS_ID not in out[1] and tok.decode(out[1].tolist()) == texts[1]
    assert len(out[2]) == 0
    assert tok.encode(texts[1]).ids.count(EOS_ID) == 1  # the flag was restored afterwards
    assert all(EOS_ID not in a for a in ids)


def test_tokenizer_errors(tmp_path):
    with pytest.raises(MfggufError, match="at least 257"):
        train_tokenizer(["abc"], 256)
    with pytest.raises(MfggufError, match="tokenizer not found"):
        load_tokenizer(tmp_path / "none.json")
    (tmp_path / "bad.json").write_text("{ nope")
    with pytest.raises(MfggufError, match="unreadable"):
        load_tokenizer(tmp_path / "bad.json")
    assert token_dtype(65535) == np.uint16 and token_dtype(65536) == np.uint32


# ---- held-out split ----------------------------------------------------------------------------------


def test_split_per_domain_and_deterministic():
    domains = ["a"] * 100 + ["b"] * 10 + ["c"] * 2 + ["d"]
    train, held = draw_split(domains, 0.05, seed=3)
    assert len(np.intersect1d(train, held)) == 0 and len(train) + len(held) == len(domains)
    assert Counter(domains[i] for i in held) == {"a": 5, "b": 1, "c": 1}  # d has one doc: kept for training
    assert np.array_equal(draw_split(domains, 0.05, seed=3)[1], held)
    assert not np.array_equal(draw_split(domains, 0.05, seed=4)[1], held)
    assert len(draw_split(domains, 0.0)[1]) == 0


# ---- label -------------------------------------------------------------------------------------------


def test_label_partition_is_pure_and_covers_everything(corpus):
    docs, _, ids = corpus
    domains = [d.domain for d in docs]
    names = sorted(set(domains))
    lengths = [len(a) for a in ids]
    for n in (len(names), len(names) + 2):
        p = partition_label(domains, n, lengths=lengths)
        assert len(p.shards) == n and all(len(s) for s in p.shards)
        assert all(len(c) == 1 for c in p.composition)  # one domain per expert
        assert sorted(np.concatenate(p.shards).tolist()) == list(range(len(docs)))  # each doc exactly once
        assert {next(iter(c)) for c in p.composition} == set(names)
    # a domain split over several experts is split evenly by tokens
    p = partition_label(domains, len(names) + 2, lengths=lengths)
    per = {}
    for c in p.composition:
        (d, t), = c.items()
        per.setdefault(d, []).append(t)
    multi = [v for v in per.values() if len(v) > 1]
    assert multi and all(max(v) < 1.2 * min(v) for v in multi)
    # fewer experts than domains: round-robin, still disjoint and complete
    p = partition_label(domains, 2, lengths=lengths)
    assert [set(c) for c in p.composition] == [{names[0], names[2]} if len(names) > 2 else {names[0]}, {names[1]}]


# ---- random ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("overlap", [0.0, 0.3])
def test_random_partition_overlap_fraction(overlap):
    n_docs, n = 4000, 4
    domains = ["a", "b"] * (n_docs // 2)
    p = partition_random(n_docs, n, domains=domains, overlap=overlap, seed=1)
    memberships = Counter(np.concatenate(p.shards).tolist())
    assert set(memberships) == set(range(n_docs))  # every doc somewhere
    assert max(memberships.values()) <= 2  # at most one extra expert
    frac2 = sum(v == 2 for v in memberships.values()) / n_docs
    assert abs(frac2 - overlap) < 0.03
    assert all(len(np.unique(s)) == len(s) for s in p.shards)  # never twice in one shard
    sizes = [len(s) for s in p.shards]
    assert max(sizes) < 1.15 * min(sizes)
    assert sum(sum(c.values()) for c in p.composition) == sum(sizes)


# ---- cluster -----------------------------------------------------------------------------------------


def test_cluster_partition_is_balanced_and_separates_code_from_prose(corpus):
    docs, _, ids = corpus
    py = [i for i, d in enumerate(docs) if d.domain == "python"]
    en = [i for i, d in enumerate(docs) if d.domain == "english"]
    m = min(len(py), len(en))
    sel = py[:m] + en[:m]
    domains = [docs[i].domain for i in sel]
    p = partition_cluster([ids[i] for i in sel], 2, domains=domains, seed=0)
    sizes = [len(s) for s in p.shards]
    assert max(sizes) - min(sizes) <= 1 and sum(sizes) == len(sel)
    purity = sum(max(c.values()) for c in composition(p.shards, domains)) / len(sel)
    assert purity > 0.8, composition(p.shards, domains)
    assert p.centres.shape == (2, len(p.terms)) and p.idf.shape == p.terms.shape
    assert np.allclose(np.linalg.norm(p.centres, axis=1), 1, atol=1e-4)
    again = partition_cluster([ids[i] for i in sel], 2, domains=domains, seed=0)
    assert all(np.array_equal(a, b) for a, b in zip(p.shards, again.shards))


def test_nearest_cluster_weighs_a_document_as_the_partition_did(corpus):
    """A training document's nearest centre by `nearest_cluster` is the one the partition's own tf-idf matrix is most
    similar to, for every document (the same terms, counts and idf); most documents sit in their nearest cluster."""
    docs, _, ids = corpus
    domains = [d.domain for d in docs]
    p = partition_cluster(ids, 4, domains=domains, seed=1)
    _, _, X = _tfidf(ids, 4096)
    want = np.argmax(X.dot(p.centres), axis=1)  # (docs,)
    got = np.array([nearest_cluster(d, p.centres, p.terms, p.idf) for d in ids])
    assert np.array_equal(got, want)
    label = np.zeros(len(ids), dtype=np.int64)
    for k, s in enumerate(p.shards):
        label[s] = k
    assert (got == label).mean() > 0.7, (got == label).mean()  # the balance moves a few to their second choice


def test_cluster_partition_balanced_with_more_clusters_and_overlap(corpus):
    docs, _, ids = corpus
    domains = [d.domain for d in docs]
    p = partition("cluster", ids, domains, 5, overlap=0.0, seed=2)
    sizes = [len(s) for s in p.shards]
    assert max(sizes) - min(sizes) <= 1
    q = partition("cluster", ids, domains, 5, overlap=0.5, seed=2)
    extra = sum(len(s) for s in q.shards) - len(docs)
    assert 0.3 * len(docs) < extra < 0.7 * len(docs)
    with pytest.raises(MfggufError, match="at least 5 training documents"):
        partition("cluster", ids[:3], domains[:3], 5)
    with pytest.raises(MfggufError, match="unknown partition"):
        partition("bogus", ids, domains, 2)
