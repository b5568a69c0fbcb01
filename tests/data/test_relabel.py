"""Relabelling's pure steps: a shard cut back into documents, and the capacity-bounded assignment."""

from __future__ import annotations

import numpy as np
import pytest

from mfgguf.data.relabel import assign_balanced, documents
from mfgguf.errors import MfggufError


def test_documents_are_the_spans_between_eos():
    t = np.array([5, 6, 0, 0, 7, 0, 8, 9])  # an empty document between two EOS, a tail without one
    assert documents(t, eos=0) == [(0, 2), (4, 5), (6, 8)]
    assert documents(np.array([0, 0]), eos=0) == []


def test_assignment_is_the_argmin_when_nothing_is_full():
    losses = np.array([[1.0, 2.0, 3.0], [2.0, 0.5, 1.0], [3.0, 2.0, 0.1]])
    assert assign_balanced(losses, np.ones(3), cap=1.0).tolist() == [0, 1, 2]
    assert assign_balanced(losses, np.ones(3), cap=np.inf).tolist() == [0, 1, 2]


def test_a_generalist_cannot_take_everything_and_the_surest_keep_their_choice():
    # expert 0 is best on every document; with cap 1 each expert holds at most the mean share (2 of 4 tokens)
    losses = np.array([[1.0, 3.0], [1.0, 1.1], [1.0, 2.0], [1.0, 1.05]])
    got = assign_balanced(losses, np.ones(4), cap=1.0)
    assert got.tolist() == [0, 1, 0, 1]  # regrets 2.0, 0.1, 1.0, 0.05: the two surest stay with expert 0
    assert assign_balanced(losses, np.ones(4), cap=np.inf).tolist() == [0, 0, 0, 0]


def test_weights_are_tokens_and_an_oversized_document_still_lands():
    losses = np.array([[0.0, 1.0], [0.0, 1.0], [0.0, 1.0]])
    got = assign_balanced(losses, np.array([10, 1, 1]), cap=1.0)  # capacity 6 each: the 10-token doc fits nowhere
    assert got.tolist() == [0, 1, 1]  # it goes to its best expert, which is then full for the others
    with pytest.raises(MfggufError, match="at least 1"):
        assign_balanced(losses, np.ones(3), cap=0.5)
