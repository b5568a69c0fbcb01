"""model.py: a tied bf16 base's embedding read from its head (share_tied_embedding) computes what the f32 table did."""

from __future__ import annotations

from dataclasses import replace

import torch

from mfgguf.config import get_preset
from mfgguf.model import HeadEmbedding, Transformer, share_tied_embedding

CFG = replace(get_preset("tiny").model, vocab_size=512)


def _frozen_bf16_model(bf16_exact: bool) -> Transformer:
    """A trunk as build_expert_model leaves it: frozen, Linear weights bf16, the embedding f32, the head tied to it."""
    torch.manual_seed(0)
    m = Transformer(CFG)
    with torch.no_grad():
        table = m.tok_embd.weight.float()  # (V, C)
        if bf16_exact:
            table = table.to(torch.bfloat16).float()  # what a base published in bf16 holds
        m.tok_embd.weight.copy_(table)
        m.output.weight = torch.nn.Parameter(table.to(torch.bfloat16))  # (V, C) the head, tied
    for p in m.parameters():
        p.requires_grad_(False)
    return m


def test_a_tied_bf16_base_keeps_one_table_and_the_same_loss():
    m = _frozen_bf16_model(bf16_exact=True)
    idx = torch.randint(0, CFG.vocab_size, (2, 16))
    tgt = torch.randint(0, CFG.vocab_size, (2, 16))
    with torch.autocast("cpu", torch.bfloat16):
        before = m(idx, tgt)
    before_bytes = sum(p.numel() * p.element_size() for p in m.parameters())
    assert share_tied_embedding(m)
    assert isinstance(m.tok_embd, HeadEmbedding) and m.tok_embd.weight is m.output.weight
    with torch.autocast("cpu", torch.bfloat16):
        after = m(idx, tgt)
    assert torch.equal(before, after)  # the same lookup, bit for bit
    saved = before_bytes - sum(p.numel() * p.element_size() for p in m.parameters())
    assert saved == CFG.vocab_size * CFG.dim * 4  # the f32 table is gone, the head is not counted twice


def test_a_table_bf16_would_round_is_kept():
    m = _frozen_bf16_model(bf16_exact=False)
    assert not share_tied_embedding(m) and not isinstance(m.tok_embd, HeadEmbedding)


def test_a_trainable_embedding_is_kept():
    m = _frozen_bf16_model(bf16_exact=True)
    m.tok_embd.weight.requires_grad_(True)  # --shared copies that train the embedding
    assert not share_tied_embedding(m)
