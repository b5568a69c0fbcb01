"""A tiny chat base for the conversation tests: a real llama GGUF (random weights, a byte-level BPE trained here,
ChatML's `<|im_start|>` and `<|im_end|>` as control tokens and SmolLM2's form of ChatML as its template),
imported by `mfgguf import-base` into a RUN; and conversation JSONL written from real prose.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content']"
          " + '<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
SPECIALS = ("<|im_start|>", "<|im_end|>")


def chat_tokenizer():
    """A byte-level BPE (EOS `<|endoftext|>`, id 0) trained on real prose, with ChatML's two special tokens added."""
    from mfgguf.data.tokenizer import train_tokenizer
    from tests.converters import text_sample

    tok = train_tokenizer([text_sample(20_000)], 400)
    tok.add_special_tokens(list(SPECIALS))
    return tok


def write_chat_gguf(path: Path, *, template: str | None = CHATML, dim: int = 64, seed: int = 0) -> Path:
    """A random-weight llama GGUF (2 blocks) whose tokenizer is `chat_tokenizer` and whose chat template TEMPLATE."""
    import gguf

    tok = chat_tokenizer()
    vocab = tok.get_vocab(with_added_tokens=True)
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    merges = [m if isinstance(m, str) else " ".join(m) for m in json.loads(tok.to_str())["model"]["merges"]]
    control = {vocab["<|endoftext|>"], *(vocab[s] for s in SPECIALS)}
    V, C, ff, L = len(tokens), dim, 128, 2
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("chat-test")
    w.add_context_length(512)
    w.add_embedding_length(C)
    w.add_block_count(L)
    w.add_feed_forward_length(ff)
    w.add_head_count(4)
    w.add_head_count_kv(4)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_rope_dimension_count(C // 4)
    w.add_file_type(0)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")
    w.add_token_list(tokens)
    w.add_token_merges(merges)
    w.add_token_types([gguf.TokenType.CONTROL if i in control else gguf.TokenType.NORMAL for i in range(V)])
    w.add_bos_token_id(0)
    w.add_eos_token_id(0)
    w.add_add_bos_token(False)
    if template is not None:
        w.add_chat_template(template)
    rng = np.random.default_rng(seed)
    rand = lambda *s: (rng.standard_normal(s) * 0.05).astype(np.float32)  # noqa: E731
    w.add_tensor("token_embd.weight", rand(V, C))
    w.add_tensor("output_norm.weight", np.ones(C, np.float32))
    w.add_tensor("output.weight", rand(V, C))
    for i in range(L):
        w.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(C, np.float32))
        for name in ("attn_q", "attn_k", "attn_v", "attn_output"):
            w.add_tensor(f"blk.{i}.{name}.weight", rand(C, C))
        w.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(C, np.float32))
        w.add_tensor(f"blk.{i}.ffn_gate.weight", rand(ff, C))
        w.add_tensor(f"blk.{i}.ffn_up.weight", rand(ff, C))
        w.add_tensor(f"blk.{i}.ffn_down.weight", rand(C, ff))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def conversations(n: int, seed: int = 0) -> list[dict]:
    """N conversations of real prose: a system turn in some, one or two user/assistant exchanges each."""
    from tests.converters import text_sample

    words = text_sample(40_000).split()
    rng = np.random.default_rng(seed)

    def phrase() -> str:
        s = int(rng.integers(0, len(words) - 40))
        return " ".join(words[s: s + int(rng.integers(4, 30))])

    out = []
    for k in range(n):
        msgs = [{"role": "system", "content": "You answer in prose."}] if k % 3 == 0 else []
        for _ in range(1 + k % 2):
            msgs += [{"role": "user", "content": phrase()}, {"role": "assistant", "content": phrase()}]
        out.append({"messages": msgs})
    return out


def write_jsonl(path: Path, records: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records), encoding="utf-8")
    return path


def build_chat_run(d: Path, n_conversations: int = 120) -> Path:
    """D/run: `write_chat_gguf` imported (tiny preset, context 64), then prepared with prose (a text JSONL, domain
    `prose`) and N_CONVERSATIONS conversations (domain `chat`) into two label experts, through the CLI."""
    from typer.testing import CliRunner

    from mfgguf.cli.app import app
    from tests.converters import text_sample

    def cli(*args):
        r = CliRunner().invoke(app, [str(a) for a in args])
        assert r.exit_code == 0, r.output

    cli("import-base", write_chat_gguf(d / "base.gguf"), "--out", d / "run", "--preset", "tiny", "--ctx-len", "64")
    prose = text_sample(40_000)
    src_text = write_jsonl(d / "prose.jsonl", [{"text": prose[i: i + 800]} for i in range(0, len(prose), 800)])
    src_chat = write_jsonl(d / "chat.jsonl", conversations(n_conversations))
    cli("prepare", src_text, src_chat, "--out", d / "run", "--experts", "2", "--partition", "label", "--no-progress")
    return d / "run"
