"""An expert's label: a cluster's terms read as words, whatever spelling the tokenizer gives its tokens."""

from __future__ import annotations

import pytest
from tokenizers import ByteLevelBPETokenizer

from mfgguf.converters.plan.names import _word, expert_label


@pytest.mark.parametrize("text", ["define", "the", "été", "printf", "naïve"])
def test_a_byte_level_token_reads_as_its_text(text):
    tok = ByteLevelBPETokenizer()  # the spelling SmolLM2's and Llama 3's vocabularies use (Ġ for a space)
    spelled = "".join(tok.pre_tokenizer.pre_tokenize_str(" " + text)[0][0])
    assert spelled != text and _word(spelled) == text


@pytest.mark.parametrize("token", ["ĉ", "Ċ", "Ġ(", "ĠĠ", "▁"])  # a tab, a newline, punctuation, spaces
def test_a_token_without_letters_or_digits_is_no_term(token):
    assert _word(token) == ""


def test_a_sentencepiece_token_keeps_its_letters():
    assert _word("▁café") == "café" and _word("café") == "café"


def test_a_cluster_label_gives_its_mix_and_its_terms():
    label = expert_label({"c": 0.56, "cpp": 0.44}, partition="cluster", cluster=1, terms=["const", "void"])
    assert label == "cluster 1: c 56%, cpp 44%; const void"
