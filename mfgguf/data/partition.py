"""Split documents into a held-out set and N expert shards.

Held-out first, per domain and at document level, so no module ever trains on it. Then the
training documents go to experts by one of three rules:

  label    by domain label: many experts per big domain, or several domains per expert
  random   each document to one random expert (plus, with probability `overlap`, one more)
  cluster  c-BTM style: balanced spherical k-means over tf-idf vectors of token ids

Every function works on document indices and returns a `Partition`; `prepare` turns it into
token arrays. Everything is deterministic given `seed`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from mfgguf.errors import MfggufError

PARTITIONS = ("label", "random", "cluster")


@dataclass
class Partition:
    """shards[i]: indices (into the documents given) of expert i+1's documents, sorted.

    composition[i]: {domain: weight} of shard i (weight = `lengths` of its docs, or doc count).
    For `cluster`, `centres` (k, n_terms) f32, `terms` (n_terms,) token ids and `idf` (n_terms,).
    """

    shards: list[np.ndarray]
    composition: list[dict[str, int]]
    centres: np.ndarray | None = None
    terms: np.ndarray | None = None
    idf: np.ndarray | None = None
    extra: dict = field(default_factory=dict)


def draw_split(domains: list[str], frac: float, seed: int = 0, stream: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """(rest, drawn) document indices: the split drawn and what it leaves. Per domain: round(frac * n) docs, at least 1 when the
    domain has 2 or more docs (and frac > 0), never all of them. `stream` keys the draw: the test
    split is stream 1 (as it always was), the validation split stream 2.

    Example:
        >>> train, held = draw_split(["a", "a", "b", "b", "b"], 0.05)   # one of each held out
    """
    if not 0.0 <= frac < 1.0:
        raise MfggufError(f"held-out fraction must be in [0, 1), got {frac}")
    rng = np.random.default_rng([seed, stream])
    held = []
    for d in sorted(set(domains)):
        idx = np.array([i for i, x in enumerate(domains) if x == d])
        if frac == 0 or len(idx) < 2:
            continue
        k = min(max(1, round(frac * len(idx))), len(idx) - 1)
        held.append(rng.choice(idx, size=k, replace=False))
    held = np.sort(np.concatenate(held)) if held else np.zeros(0, dtype=np.int64)
    train = np.setdiff1d(np.arange(len(domains)), held)
    return train, held


def split_three(domains: list[str], test_frac: float, valid_frac: float, seed: int = 0
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(train, validation, test) document indices. The test split is drawn first, exactly as a RUN without a
    validation split drew its held-out one (the same documents for the same seed); validation is then drawn from
    what is left, per domain, under the same rule, so training always keeps a document of each domain.

    Example:
        >>> train, valid, test = split_three(["a"] * 3 + ["b"] * 3, 0.05, 0.05)   # one of each in each split
    """
    rest, test = draw_split(domains, test_frac, seed)
    sub, valid = draw_split([domains[i] for i in rest], valid_frac, seed, stream=2)
    return rest[sub], np.sort(rest[valid]), test


def composition(shards: list[np.ndarray], domains: list[str], lengths=None) -> list[dict[str, int]]:
    """Per shard {domain: total length} (or doc count without `lengths`), domains in sorted order."""
    out = []
    for s in shards:
        c: dict[str, int] = {}
        for i in s:
            c[domains[i]] = c.get(domains[i], 0) + (int(lengths[i]) if lengths is not None else 1)
        out.append(dict(sorted(c.items())))
    return out


def _finish(buckets: list[list[int]], domains, lengths, **kw) -> Partition:
    shards = [np.array(sorted(set(b)), dtype=np.int64) for b in buckets]
    return Partition(shards, composition(shards, domains, lengths), **kw)


def _add_overlap(buckets: list[list[int]], first: np.ndarray, overlap: float, rng, second=None) -> None:
    """With probability `overlap`, doc j also joins one more expert: `second[j]`, or a random other."""
    n = len(buckets)
    if overlap <= 0 or n < 2:
        return
    for j in np.flatnonzero(rng.random(len(first)) < overlap):
        other = second[j] if second is not None else (first[j] + 1 + rng.integers(n - 1)) % n
        buckets[other].append(j)


# ---- label -------------------------------------------------------------------------------------------


def partition_label(domains: list[str], n: int, *, lengths=None, overlap: float = 0.0, seed: int = 0) -> Partition:
    """By domain. n >= domains: each domain gets experts in proportion to its size (at least one,
    at most one per document) and its documents are split among them, balanced by length.
    n < domains: domains are dealt to experts round-robin (sorted by name).

    Example:
        >>> partition_label(["py", "py", "en", "en"], 2).shards   # [array([2, 3]), array([0, 1])]
    """
    rng = np.random.default_rng([seed, 2])
    lengths = np.ones(len(domains)) if lengths is None else np.asarray(lengths, dtype=np.float64)
    names = sorted(set(domains))
    members = {d: [i for i, x in enumerate(domains) if x == d] for d in names}
    buckets: list[list[int]] = [[] for _ in range(n)]
    if n < len(names):
        for k, d in enumerate(names):
            buckets[k % n] += members[d]
    else:
        share = _allocate(n, [float(lengths[members[d]].sum()) for d in names], [len(members[d]) for d in names])
        e = 0
        for d, m in zip(names, share):
            # greedy: each doc (shuffled) to the lightest of this domain's experts
            load = np.zeros(m)
            for i in rng.permutation(members[d]):
                j = int(np.argmin(load))
                buckets[e + j].append(int(i))
                load[j] += lengths[i]
            e += m
    first = np.zeros(len(domains), dtype=np.int64)
    for k, b in enumerate(buckets):
        first[b] = k
    _add_overlap(buckets, first, overlap, rng)
    return _finish(buckets, domains, lengths.astype(np.int64))


def _allocate(n: int, sizes: list[float], caps: list[int]) -> list[int]:
    """n experts over domains: one each, then each next one to the domain with the most size per expert (capped by its docs)."""
    share = [1] * len(sizes)
    for _ in range(n - len(sizes)):
        # give the next expert to the domain with most size per expert that can still take one
        cand = [(sizes[k] / share[k], -k) for k in range(len(sizes)) if share[k] < caps[k]]
        if not cand:
            break  # more experts than documents: prepare reports the empty shards
        k = -max(cand)[1]
        share[k] += 1
    return share


# ---- random ------------------------------------------------------------------------------------------


def partition_random(n_docs: int, n: int, *, domains: list[str], lengths=None, overlap: float = 0.0,
                     seed: int = 0) -> Partition:
    """Each document to one uniformly random expert; with probability `overlap` also to one more."""
    rng = np.random.default_rng([seed, 3])
    first = rng.integers(n, size=n_docs)
    buckets = [list(np.flatnonzero(first == k)) for k in range(n)]
    _add_overlap(buckets, first, overlap, rng)
    return _finish(buckets, domains, lengths)


# ---- cluster (c-BTM) ---------------------------------------------------------------------------------


def partition_cluster(docs: list[np.ndarray], n: int, *, domains: list[str], lengths=None, overlap: float = 0.0,
                      seed: int = 0, max_terms: int = 4096, iters: int = 20) -> Partition:
    """Balanced k-means (k = n) over L2-normalised tf-idf vectors whose terms are token ids.

    Memory stays bounded: documents are sparse (only the `max_terms` most document-frequent
    token ids are terms), centres are dense (n, n_terms). Each step assigns documents to
    centres under an equal-size capacity (ceil(docs / n)), greedily, most-decided first; centres
    are the re-normalised means (spherical k-means). With `overlap`, a document may also join
    its next-nearest cluster.
    """
    if len(docs) < n:
        raise MfggufError(f"cluster partition needs at least {n} training documents, got {len(docs)};"
                          " use fewer experts or more data")
    rng = np.random.default_rng([seed, 4])
    terms, idf, X = _tfidf(docs, max_terms)
    nd = len(docs)
    cap = math.ceil(nd / n)
    # k-means++ seeding on cosine distance
    centres = np.zeros((n, len(terms)), dtype=np.float32)
    centres[0] = X.dense_row(int(rng.integers(nd)))
    d2 = np.maximum(2 - 2 * X.dot(centres[:1])[:, 0], 0)
    for c in range(1, n):
        p = d2 / d2.sum() if d2.sum() > 0 else np.full(nd, 1 / nd)
        centres[c] = X.dense_row(int(rng.choice(nd, p=p)))
        d2 = np.minimum(d2, np.maximum(2 - 2 * X.dot(centres[c: c + 1])[:, 0], 0))
    labels = None
    for _ in range(iters):
        sim = X.dot(centres)  # (docs, n) cosine similarity
        new = _balanced_assign(sim, cap)
        if labels is not None and np.array_equal(new, labels):
            break
        labels = new
        centres = X.cluster_sums(labels, n)
        centres /= np.maximum(np.linalg.norm(centres, axis=1, keepdims=True), 1e-12)
    sim = X.dot(centres)
    buckets = [list(np.flatnonzero(labels == k)) for k in range(n)]
    masked = sim.copy()
    masked[np.arange(nd), labels] = -np.inf
    _add_overlap(buckets, labels, overlap, rng, second=np.argmax(masked, axis=1) if n > 1 else None)
    return _finish(buckets, domains, lengths, centres=centres.astype(np.float32), terms=terms, idf=idf)


def _balanced_assign(sim: np.ndarray, cap: int) -> np.ndarray:
    """Each doc to its most similar cluster that has room; docs with the most to lose choose first."""
    nd, k = sim.shape
    order = np.argsort(-sim, axis=1)
    top2 = np.take_along_axis(sim, order[:, :2], axis=1) if k > 1 else np.concatenate([sim, sim], axis=1)
    regret = top2[:, 0] - top2[:, 1]
    load = np.zeros(k, dtype=np.int64)
    labels = np.empty(nd, dtype=np.int64)
    for i in np.argsort(-regret, kind="stable"):
        for c in order[i]:
            if load[c] < cap:
                labels[i] = c
                load[c] += 1
                break
    return labels


class _Sparse:
    """CSR rows of L2-normalised tf-idf: ptr (docs+1,), col (nnz,), val (nnz,) f32."""

    def __init__(self, ptr, col, val, n_cols):
        self.ptr, self.col, self.val, self.n_cols = ptr, col, val, n_cols
        self.row = np.repeat(np.arange(len(ptr) - 1), np.diff(ptr))

    def dense_row(self, i: int) -> np.ndarray:
        v = np.zeros(self.n_cols, dtype=np.float32)
        v[self.col[self.ptr[i]: self.ptr[i + 1]]] = self.val[self.ptr[i]: self.ptr[i + 1]]
        return v

    def dot(self, centres: np.ndarray, chunk: int = 1 << 20) -> np.ndarray:
        """(docs, k) = X @ centres.T, nnz processed in chunks to bound memory."""
        nd = len(self.ptr) - 1
        out = np.zeros((nd, len(centres)), dtype=np.float64)
        for s in range(0, len(self.col), chunk):
            sl = slice(s, s + chunk)
            contrib = self.val[sl, None] * centres.T[self.col[sl]]  # (chunk, k)
            for c in range(len(centres)):
                out[:, c] += np.bincount(self.row[sl], weights=contrib[:, c], minlength=nd)
        return out

    def cluster_sums(self, labels: np.ndarray, k: int) -> np.ndarray:
        flat = labels[self.row] * self.n_cols + self.col
        return np.bincount(flat, weights=self.val, minlength=k * self.n_cols).reshape(k, self.n_cols).astype(np.float32)


def _tfidf(docs: list[np.ndarray], max_terms: int) -> tuple[np.ndarray, np.ndarray, _Sparse]:
    """Terms = the `max_terms` token ids found in most documents; tf = count, idf = log((1+N)/(1+df))+1."""
    vocab = int(max((int(d.max()) for d in docs if len(d)), default=0)) + 1
    df = np.zeros(vocab, dtype=np.int64)
    uniq = [np.unique(d) for d in docs]
    for u in uniq:
        df[u] += 1
    terms = np.sort(np.argsort(-df, kind="stable")[: min(max_terms, int((df > 0).sum()))])
    column = np.full(vocab, -1, dtype=np.int64)
    column[terms] = np.arange(len(terms))
    idf = (np.log((1 + len(docs)) / (1 + df[terms])) + 1).astype(np.float32)
    ptr, cols, vals = [0], [], []
    for d in docs:
        c = column[d]
        c = c[c >= 0]
        u, tf = np.unique(c, return_counts=True)
        v = tf * idf[u]
        v = v / max(float(np.linalg.norm(v)), 1e-12)
        cols.append(u)
        vals.append(v.astype(np.float32))
        ptr.append(ptr[-1] + len(u))
    X = _Sparse(np.array(ptr), np.concatenate(cols) if cols else np.zeros(0, np.int64),
                np.concatenate(vals) if vals else np.zeros(0, np.float32), len(terms))
    return terms.astype(np.int64), idf, X


def nearest_cluster(doc: np.ndarray, centres: np.ndarray, terms: np.ndarray, idf: np.ndarray) -> int:
    """The cluster (0-based: expert k+1's) whose centre is nearest a new document's tf-idf vector, as `_tfidf` weighs
    a training document; centres, terms, idf as `partition_cluster` made them (data/clusters.safetensors)."""
    column = np.full(max(int(terms.max()), int(np.max(doc, initial=0))) + 1, -1, dtype=np.int64)
    column[terms] = np.arange(len(terms))
    u, tf = np.unique(column[np.asarray(doc, dtype=np.int64)], return_counts=True)
    tf, u = tf[u >= 0], u[u >= 0]
    v = np.zeros(len(terms), dtype=np.float32)  # (n_terms,)
    v[u] = tf * idf[u]
    return int(np.argmax(centres @ v))  # the norm of v does not change the argmax


def partition(name: str, docs: list[np.ndarray], domains: list[str], n: int, *, overlap: float = 0.0,
              seed: int = 0) -> Partition:
    """Dispatch to `partition_label` / `partition_random` / `partition_cluster`; weights = token counts."""
    lengths = np.array([len(d) for d in docs], dtype=np.int64)
    if name == "label":
        return partition_label(domains, n, lengths=lengths, overlap=overlap, seed=seed)
    if name == "random":
        return partition_random(len(docs), n, domains=domains, lengths=lengths, overlap=overlap, seed=seed)
    if name == "cluster":
        return partition_cluster(docs, n, domains=domains, lengths=lengths, overlap=overlap, seed=seed)
    raise MfggufError(f"unknown partition {name!r}; use one of: {', '.join(PARTITIONS)}")
