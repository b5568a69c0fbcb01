"""The tokenizer keys a RUN's GGUF carries: an imported base's own, or those of the RUN's byte-level BPE."""

from __future__ import annotations

import json
from pathlib import Path


from mfgguf.base.runbase import imported
from mfgguf.errors import MfggufError
from mfgguf.run import RunDir
from mfgguf.gguf import schema



def run_tokenizer_kv(run: RunDir) -> tuple[list[tuple[str, str, object]], int]:
    """The tokenizer keys a RUN's GGUF carries and its vocabulary size: an imported base's own, copied
    unchanged (base/runbase.py), else those of the RUN's byte-level BPE."""
    base = imported(run.root)
    if base is not None:
        kv, vocab, _ = base.gguf_kv()
        return kv, vocab
    return tokenizer_kv(run.tokenizer)


def tokenizer_kv(path: Path) -> tuple[list[tuple[str, str, object]], int]:
    """GGUF tokenizer keys for a byte-level BPE tokenizer.json, and its vocabulary size."""
    if not path.is_file():
        raise MfggufError(f"tokenizer not found: {path}; create the run with `mfgguf prepare`")
    try:
        tj = json.loads(path.read_text(encoding="utf-8"))
        model = tj["model"]
        vocab: dict[str, int] = dict(model["vocab"])
        merges = model.get("merges", [])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise MfggufError(f"tokenizer {path} is unreadable ({e}); re-create the run with `mfgguf prepare`") from None
    if model.get("type", "BPE") != "BPE":
        raise MfggufError(f"tokenizer {path} is {model.get('type')}, not byte-level BPE; re-create the run with `mfgguf prepare`")
    added = {a["content"]: a for a in tj.get("added_tokens", [])}
    for a in added.values():
        vocab.setdefault(a["content"], a["id"])
    n = max(vocab.values()) + 1
    tokens: list[str | None] = [None] * n
    for s, i in vocab.items():
        tokens[i] = s
    if any(t is None for t in tokens):
        raise MfggufError(f"tokenizer {path} has gaps in its token ids; re-create the run with `mfgguf prepare`")
    types = [schema.TOKEN_NORMAL] * n
    for a in added.values():
        types[a["id"]] = schema.TOKEN_CONTROL if a.get("special") else 4  # 4: USER_DEFINED
    merges = [m if isinstance(m, str) else " ".join(m) for m in merges]
    eos = vocab.get(schema.EOS_TOKEN)
    if eos is None:
        raise MfggufError(f"tokenizer {path} has no {schema.EOS_TOKEN} token; re-create the run with `mfgguf prepare`")
    kv = [
        ("tokenizer.ggml.model", "STRING", "gpt2"),
        ("tokenizer.ggml.pre", "STRING", "gpt-2"),
        ("tokenizer.ggml.tokens", "ARRAY", ("STRING", tokens)),
        ("tokenizer.ggml.token_type", "ARRAY", ("INT32", types)),
        ("tokenizer.ggml.merges", "ARRAY", ("STRING", merges)),
        ("tokenizer.ggml.bos_token_id", "UINT32", eos),  # GPT-2 style: one token opens and ends documents
        ("tokenizer.ggml.eos_token_id", "UINT32", eos),
        ("tokenizer.ggml.padding_token_id", "UINT32", eos),
        ("tokenizer.ggml.add_bos_token", "BOOL", False),  # training sequences carry no BOS
        ("tokenizer.ggml.add_eos_token", "BOOL", False),
        ("tokenizer.chat_template", "STRING", schema.CHAT_TEMPLATE),
    ]
    return kv, n
