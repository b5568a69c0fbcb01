"""A GGUF's vocabulary as Hugging Face tokenizer files: tokenizer.json, tokenizer_config.json (with the chat template).

The reverse of base/hf_vocab.py: byte-level BPE only (`tokenizer.ggml.model = gpt2`); the GGUF's tokens,
already in byte-level form, are the BPE vocabulary and its merges the merges. llama.cpp splits text
before BPE by its pre-tokenizer (`tokenizer.ggml.pre`, llama-vocab.cpp); each one mfgguf's files carry
is written as the `tokenizers` pre-tokenizer that splits the same way: `gpt-2` (mfgguf's own tokenizer)
the GPT-2 byte-level regex, `smollm` digits one at a time first (SmolLM2's tokenizer.json), `llama-bpe`
and `qwen2` their Split regexes (with llama-bpe's ignore_merges, as llama.cpp sets it). Any other is
refused in one line. CONTROL tokens become special added tokens, USER_DEFINED ones plain added tokens;
a BOS the file adds (`add_bos_token`) becomes the post-processor's.

Example:
    >>> files = tokenizer_files(src)
    >>> sorted(files)
    ['special_tokens_map.json', 'tokenizer.json', 'tokenizer_config.json']
"""

from __future__ import annotations

import json

from mfgguf.base.hf_vocab import LLAMA3_REGEX, QWEN2_REGEX
from mfgguf.converters.hf.source import GGUFSource
from mfgguf.errors import MfggufError
from mfgguf.gguf.schema import TOKEN_CONTROL

TOKEN_USER_DEFINED = 4  # llama.cpp's llama_token_type: an added token that is not special
SPLIT = {"llama-bpe": LLAMA3_REGEX, "llama3": LLAMA3_REGEX, "llama-v3": LLAMA3_REGEX, "qwen2": QWEN2_REGEX}
BYTE_LEVEL = ("gpt-2", "smollm")  # GPT-2's own regex inside ByteLevel (smollm: after splitting digits)
IGNORE_MERGES = ("llama-bpe", "llama3", "llama-v3")  # a word already in the vocabulary is one token
ADD_BOS = ("llama-bpe", "llama3", "llama-v3")  # llama.cpp's add_bos default where the file says nothing


def pre_tokenizer(pre: str, what: str):
    """The `tokenizers` pre-tokenizer that splits text as llama.cpp's pre-tokenizer `pre` does."""
    from tokenizers import Regex, pre_tokenizers as P

    if pre in BYTE_LEVEL:
        byte_level = P.ByteLevel(add_prefix_space=False, use_regex=True)
        return byte_level if pre == "gpt-2" else P.Sequence([P.Digits(individual_digits=True), byte_level])
    if pre in SPLIT:
        return P.Sequence([P.Split(Regex(SPLIT[pre]), behavior="isolated", invert=False),
                           P.ByteLevel(add_prefix_space=False, use_regex=False)])
    raise MfggufError(f"{what}: its pre-tokenizer {pre!r} is not one export-hf writes"
                      f" ({', '.join([*BYTE_LEVEL, *SPLIT])})")


def build_tokenizer(src: GGUFSource):
    """The `tokenizers.Tokenizer` of the file's vocabulary and its tokens."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, processors

    what = str(src.path)
    if src.kv("tokenizer.ggml.model", "") != "gpt2":
        raise MfggufError(f"{what}: its tokenizer is {src.kv('tokenizer.ggml.model', 'missing')!r}, not byte-level BPE"
                          " (gpt2); export-hf writes byte-level BPE tokenizers only")
    tokens = [str(t) for t in src.kv("tokenizer.ggml.tokens")]
    types = [int(t) for t in src.kv("tokenizer.ggml.token_type", [1] * len(tokens))]
    merges = [tuple(str(m).split(" ", 1)) for m in src.kv("tokenizer.ggml.merges", [])]
    if len(set(tokens)) != len(tokens):
        raise MfggufError(f"{what}: its vocabulary holds a token twice, which a Hugging Face tokenizer cannot map")
    pre = str(src.kv("tokenizer.ggml.pre", "gpt-2"))
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges,
                               ignore_merges=pre in IGNORE_MERGES))
    tok.pre_tokenizer = pre_tokenizer(pre, what)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, k in zip(tokens, types) if k == TOKEN_CONTROL])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t, k in zip(tokens, types) if k == TOKEN_USER_DEFINED])
    bos = src.kv("tokenizer.ggml.bos_token_id", None)
    if bool(src.kv("tokenizer.ggml.add_bos_token", pre in ADD_BOS)) and bos is not None:
        b = tokens[int(bos)]
        tok.post_processor = processors.TemplateProcessing(single=f"{b} $A", pair=f"{b} $A {b} $B",
                                                           special_tokens=[(b, int(bos))])
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return tok, tokens


def tokenizer_files(src: GGUFSource) -> dict[str, str]:
    """{file name: text} of the tokenizer files for the directory."""
    tok, tokens = build_tokenizer(src)
    special = {}
    for k in ("bos", "eos", "unknown", "padding"):
        i = src.kv(f"tokenizer.ggml.{k}_token_id", None)
        if i is not None and 0 <= int(i) < len(tokens):
            special[{"unknown": "unk", "padding": "pad"}.get(k, k) + "_token"] = tokens[int(i)]
    config = {"tokenizer_class": "PreTrainedTokenizerFast", **special,
              "model_max_length": int(src.kv(f"{src.arch}.context_length", 2048)),
              "clean_up_tokenization_spaces": False}
    template = src.kv("tokenizer.chat_template", None)
    if template is not None:
        config["chat_template"] = str(template)
    return {"tokenizer.json": tok.to_str(pretty=True), "tokenizer_config.json": json.dumps(config, indent=2) + "\n",
            "special_tokens_map.json": json.dumps(special, indent=2) + "\n"}
