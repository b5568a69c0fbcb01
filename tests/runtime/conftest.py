"""Fixtures for the runtime verbs: a real assembled GGUF, plus small GGUFs written with gguf-py.

`tiny_gguf` is what the pipeline makes: the session's trained tiny run assembled as an f32
granitemoe GGUF. `talker_gguf` is a real llama GGUF built here whose output never ends (its
end-of-text logit is pinned far below the rest), so a test can interrupt a long reply.
"""

from __future__ import annotations

import json
import socket
import sys
from pathlib import Path

import numpy as np
import pytest

MFGGUF = str(Path(sys.executable).parent / "mfgguf")  # the installed console script


@pytest.fixture(scope="session")
def tiny_gguf(trained_run, tmp_path_factory) -> Path:
    """The trained tiny run assembled by `mfgguf assemble` as f32 (granitemoe, all experts, top-1)."""
    from mfgguf.converters.assemble import assemble

    out = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    assemble(trained_run, out, quant="f32", progress=False)
    return out


def _bpe(vocab_size: int = 512):
    """A byte-level BPE trained on the standard library's bundled English docs (the tokenizer module's recipe)."""
    import pydoc_data.topics
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(list(pydoc_data.topics.topics.values()), trainer)
    return tok


def write_gguf(path: Path, *, arch: str = "llama", ctx: int = 4096, dim: int = 64, header_only: bool = False) -> Path:
    """A llama-layout GGUF that talks forever: every position sees the same hidden state.

    Attention and FFN weights are zero and all embeddings equal, so the residual stream is a
    constant vector u and the logits are output.weight @ u: a fixed distribution over word-like
    tokens, with end-of-text pinned at -100. `arch` other than llama (with header_only) makes a
    file of another architecture for the error tests.
    """
    import gguf

    tok = _bpe()
    vocab = tok.get_vocab()
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    merges = [m if isinstance(m, str) else " ".join(m) for m in json.loads(tok.to_str())["model"]["merges"]]
    eos = vocab["<|endoftext|>"]
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(f"test-{arch}")
    w.add_context_length(ctx)
    w.add_embedding_length(dim)
    w.add_block_count(1)
    w.add_feed_forward_length(dim)
    w.add_head_count(4)
    w.add_head_count_kv(4)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_file_type(0)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")
    w.add_token_list(tokens)
    w.add_token_merges(merges)
    w.add_token_types([gguf.TokenType.CONTROL if i == eos else gguf.TokenType.NORMAL for i in range(len(tokens))])
    w.add_bos_token_id(eos)
    w.add_eos_token_id(eos)
    w.add_add_bos_token(False)
    w.add_chat_template("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                        "{% if add_generation_prompt %}assistant:{% endif %}")
    if not header_only:
        V, C = len(tokens), dim
        u = np.ones(C, np.float32)  # rmsnorm(ones) = ones
        rng = np.random.default_rng(0)
        wordy = np.array([t.lstrip("Ġ").isalpha() and len(t) > 2 for t in tokens])
        score = np.where(wordy, rng.uniform(0, 2, V), -30.0).astype(np.float32)  # (V,)
        score[eos] = -100.0
        zeros = lambda *s: np.zeros(s, np.float32)
        w.add_tensor("token_embd.weight", np.tile(u, (V, 1)))  # (V, C): every token embeds to u
        w.add_tensor("output_norm.weight", u)
        w.add_tensor("output.weight", np.outer(score, u) / C)  # (V, C): logits = score
        w.add_tensor("blk.0.attn_norm.weight", u)
        for name in ("attn_q", "attn_k", "attn_v", "attn_output"):
            w.add_tensor(f"blk.0.{name}.weight", zeros(C, C))
        w.add_tensor("blk.0.ffn_norm.weight", u)
        w.add_tensor("blk.0.ffn_gate.weight", zeros(C, C))
        w.add_tensor("blk.0.ffn_up.weight", zeros(C, C))
        w.add_tensor("blk.0.ffn_down.weight", zeros(C, C))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="session")
def talker_gguf(tmp_path_factory) -> Path:
    return write_gguf(tmp_path_factory.mktemp("talker") / "talker.gguf")


@pytest.fixture(scope="session")
def gpt2_gguf(tmp_path_factory) -> Path:
    """A GGUF header of another architecture (gpt2), no weights."""
    return write_gguf(tmp_path_factory.mktemp("gpt2") / "gpt2.gguf", arch="gpt2", header_only=True)


def free_port() -> int:
    """A loopback port nobody listens on right now (bind port 0, read it, release it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
