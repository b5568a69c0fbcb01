"""A Hugging Face base's tokenizer as GGUF key-values, written the way llama.cpp's convert_hf_to_gguf.py does.

Byte-level BPE only (`tokenizer.ggml.model = gpt2`): tokens from tokenizer.json (vocab + added
tokens, padded to the model's vocab_size with `[PAD{i}]` rows of type UNUSED), types NORMAL /
CONTROL (special added tokens) / USER_DEFINED, and gguf-py's `SpecialVocab` for the merges, the
special token ids, add_bos/add_eos and the chat template -- the converter's own code path. The
pre-tokenizer name llama.cpp needs is read from the pre-tokenizer itself (a few known regexes); any
other tokenizer is refused with the way out: convert the model with convert_hf_to_gguf.py and
import that GGUF.
"""

from __future__ import annotations

import json
from pathlib import Path

from mfgguf.errors import MfggufError
from mfgguf.base.source import TOKEN_UNUSED

TOKEN_NORMAL, TOKEN_CONTROL, TOKEN_USER_DEFINED = 1, 3, 4
LLAMA3_REGEX = ("(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*"
                "|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+")
QWEN2_REGEX = LLAMA3_REGEX.replace("\\p{N}{1,3}", "\\p{N}")  # Qwen2 / Qwen2.5: digits one at a time
# Split(regex) + ByteLevel(use_regex=false) -> llama.cpp pre-tokenizer
SPLIT_PRE = {LLAMA3_REGEX: "llama-bpe", QWEN2_REGEX: "qwen2"}


def pre_tokenizer_name(pre: dict | None, what: str) -> str:
    """llama.cpp's `tokenizer.ggml.pre` for a tokenizer.json pre-tokenizer, or a one-line refusal."""
    hint = "convert it with llama.cpp's convert_hf_to_gguf.py and import that GGUF"
    if pre and pre.get("type") == "ByteLevel" and pre.get("use_regex", True):
        return "gpt-2"
    if pre and pre.get("type") == "Sequence":
        seq = pre.get("pretokenizers") or []
        if (len(seq) == 2 and seq[0].get("type") == "Split" and seq[1].get("type") == "ByteLevel"
                and not seq[1].get("use_regex", True)):
            regex = (seq[0].get("pattern") or {}).get("Regex")
            if regex in SPLIT_PRE:
                return SPLIT_PRE[regex]
    raise MfggufError(f"{what}: its tokenizer's pre-tokenizer is not one mfgguf maps to llama.cpp's; {hint}")


def write_vocab_gguf(base, path: Path) -> None:
    """Write a vocab-only GGUF (architecture keys + tokenizer keys, no tensors) for an HFBase."""
    import gguf

    what = f"base {base.path.name}"
    tj = json.loads(base.tokenizer_json.read_text(encoding="utf-8"))
    model = tj.get("model") or {}
    if model.get("type") != "BPE" or (tj.get("decoder") or {}).get("type") != "ByteLevel":
        raise MfggufError(f"{what}: its tokenizer is not byte-level BPE ({model.get('type')}); convert it with"
                          " llama.cpp's convert_hf_to_gguf.py and import that GGUF")
    pre = pre_tokenizer_name(tj.get("pre_tokenizer"), what)
    n = base.shape.vocab_size
    reverse = {i: t for t, i in model["vocab"].items()}
    added = {a["id"]: a for a in tj.get("added_tokens", [])}
    for i, a in added.items():
        reverse[i] = a["content"]
    if max(reverse) >= n:
        raise MfggufError(f"{what}: its tokenizer has token id {max(reverse)} but the model only {n} embedding rows")
    tokens, types = [], []
    for i in range(n):
        if i not in reverse:
            tokens.append(f"[PAD{i}]")
            types.append(TOKEN_UNUSED)
            continue
        tokens.append(reverse[i])
        types.append((TOKEN_CONTROL if added[i].get("special") else TOKEN_USER_DEFINED) if i in added else TOKEN_NORMAL)
    s = base.shape
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_context_length(s.ctx_len)
    w.add_embedding_length(s.dim)
    w.add_block_count(s.n_layers)
    w.add_feed_forward_length(s.ff)
    w.add_head_count(s.n_heads)
    w.add_head_count_kv(s.n_kv_heads)
    w.add_rope_freq_base(s.rope_theta)
    w.add_layer_norm_rms_eps(s.norm_eps)
    w.add_rope_dimension_count(s.dim // s.n_heads)
    tc = base.path / "tokenizer_config.json"
    if tc.is_file() and (space := json.loads(tc.read_text(encoding="utf-8")).get("add_prefix_space")) is not None:
        w.add_add_space_prefix(space)  # as the converter's LlamaModel.set_vocab
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    special = gguf.SpecialVocab(base.path, load_merges=True, n_vocab=n)
    if (tj.get("post_processor") or {}).get("type") == "ByteLevel":  # as the converter's own (newer) gguf-py reads it
        special.add_special_token.setdefault("bos", False)
        special.add_special_token.setdefault("eos", False)
    special.add_to_gguf(w, quiet=True)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    w.close()
