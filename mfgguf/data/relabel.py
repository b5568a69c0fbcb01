"""Relabelling a partition by the experts themselves: documents and a balanced assignment.

One EM round, as SmallTalk LM does: after experts have trained on a partition (the E step was
the partition), each training document goes to the expert that predicts it best (the M step
here is retraining them on the new shards). The loss matrix comes from train/whole/relabel.py; this
file holds the two pure steps: cut a shard back into its documents, and assign documents to
experts under a capacity, so that an expert that is better everywhere (a generalist) cannot
take every shard.

Example:
    >>> spans = documents(np.array([5, 6, 0, 7, 0]), eos=0)      # [(0, 2), (3, 4)]
    >>> assign_balanced(np.array([[1.0, 2.0], [0.5, 0.4]]), np.array([3, 2]), cap=2.0)
    array([0, 1])
"""

from __future__ import annotations

import numpy as np

from mfgguf.errors import MfggufError


def documents(tokens: np.ndarray, eos: int) -> list[tuple[int, int]]:
    """(start, end) of each document of a shard written by `prepare` (documents each followed by EOS;
    end excludes the EOS). A tail without EOS is a document too; empty documents are dropped."""
    ends = np.flatnonzero(np.asarray(tokens) == eos)  # (n_docs,)
    starts = np.concatenate([[0], ends + 1])
    ends = np.concatenate([ends, [len(tokens)]])
    return [(int(s), int(e)) for s, e in zip(starts, ends) if e > s]


def assign_balanced(losses: np.ndarray, weights: np.ndarray, cap: float) -> np.ndarray:
    """Column of the chosen expert for each document: the lowest loss, under a capacity of `cap` x the
    mean share of the total weight per expert.

    losses (D, E): each document's mean loss under each expert; weights (D,): its tokens. Documents
    are placed in order of regret (second-best loss minus best: the surest first), each to the best
    expert with room left; a document that fits nowhere goes to its best expert anyway (only possible
    when one document outweighs a whole capacity). cap=inf is the plain argmin.
    """
    losses = np.asarray(losses, dtype=np.float64)
    weights = np.asarray(weights, dtype=np.float64)
    if losses.ndim != 2 or losses.shape[0] != len(weights):
        raise MfggufError(f"losses {losses.shape} and weights {weights.shape} do not describe the same documents")
    if not cap >= 1.0:
        raise MfggufError(f"--cap must be at least 1 (a shard may hold cap x the mean share), got {cap}")
    D, E = losses.shape
    order = np.argsort(losses, axis=1)  # (D, E) experts from best to worst per document
    if E == 1 or np.isinf(cap):
        return order[:, 0].copy()
    sorted_l = np.take_along_axis(losses, order, axis=1)
    regret = sorted_l[:, 1] - sorted_l[:, 0]  # (D,)
    room = np.full(E, cap * weights.sum() / E)
    out = np.empty(D, dtype=np.int64)
    for d in np.argsort(-regret, kind="stable"):
        fits = [e for e in order[d] if room[e] >= weights[d]]
        e = fits[0] if fits else order[d, 0]
        out[d] = e
        room[e] -= weights[d]
    return out
