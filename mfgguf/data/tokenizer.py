"""Byte-level BPE tokenizer, trained with `tokenizers` in the exact form llama.cpp reproduces.

The pre-tokenizer is `ByteLevel(add_prefix_space=False)` (GPT-2 regex + byte mapping), the
decoder `ByteLevel`, there is no normalizer, and the initial alphabet is all 256 byte symbols, so
any byte string round-trips. llama.cpp, given `tokenizer.ggml.model = "gpt2"` and
`tokenizer.ggml.pre = "gpt-2"`, tokenizes text identically (tests/converters/test_parity.py checks it). The only special
token is `<|endoftext|>`, id 0: it ends every document and is the model's EOS.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable, Iterator

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from mfgguf.errors import MfggufError

EOS_TOKEN = "<|endoftext|>"
EOS_ID = 0
MIN_VOCAB = 256 + 1  # every byte, plus EOS


def train_tokenizer(texts: Iterable[str], vocab_size: int, *, progress: bool = False) -> Tokenizer:
    """Train a byte-level BPE of at most `vocab_size` tokens (EOS included) on `texts`.

    The result may be smaller than `vocab_size` when the text has fewer distinct merges.

    Example:
        >>> tok = train_tokenizer(["def f(x):\\n    return x\\n"] * 100, 300)
        >>> tok.decode(tok.encode("def g(y): pass").ids)
        'def g(y): pass'
    """
    if vocab_size < MIN_VOCAB:
        raise MfggufError(f"vocab size {vocab_size} is too small; byte-level BPE needs at least {MIN_VOCAB}")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TOKEN],  # first special token gets id 0
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=progress,
    )
    tok.train_from_iterator(texts, trainer)
    if tok.token_to_id(EOS_TOKEN) != EOS_ID:
        raise AssertionError("EOS must be token 0")  # a tokenizers change would break every RUN
    return tok


def load_tokenizer(path: Path) -> Tokenizer:
    """Load a tokenizer.json written by `prepare` (RUN/tokenizer.json)."""
    path = Path(path)
    if path.is_dir():
        path = path / "tokenizer.json"
    if not path.is_file():
        raise MfggufError(f"tokenizer not found: {path}; create the run with `mfgguf prepare`")
    try:
        tok = Tokenizer.from_file(str(path))
    except Exception as e:  # tokenizers raises a bare Exception on bad JSON
        raise MfggufError(f"tokenizer {path} is unreadable ({e}); re-create the run with `mfgguf prepare`") from None
    if tok.token_to_id(EOS_TOKEN) is None:
        raise MfggufError(f"tokenizer {path} has no {EOS_TOKEN} token; re-create the run with `mfgguf prepare`")
    return tok


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 while every id fits, else uint32."""
    return np.dtype(np.uint16 if vocab_size <= 65535 else np.uint32)


def encode_documents(tok: Tokenizer, texts: list[str], *, batch: int = 256, dtype=np.uint32,
                     on_batch=None) -> Iterator[np.ndarray]:
    """Token ids of each text (no EOS added), batch by batch with `encode_batch`.

    Special-token text inside documents (a literal "<|endoftext|>") is encoded as plain bytes,
    so only the EOS that `prepare` appends ends a document. `on_batch(n_texts, n_tokens)` is
    called after each batch (progress).
    """
    prev = tok.encode_special_tokens
    tok.encode_special_tokens = True
    encode = getattr(tok, "encode_batch_fast", tok.encode_batch)  # no offsets: faster where available
    try:
        for i in range(0, len(texts), batch):
            chunk = texts[i: i + batch]
            encs = encode(chunk, add_special_tokens=False)
            n = 0
            for e in encs:
                ids = np.asarray(e.ids, dtype=dtype)
                n += len(ids)
                yield ids
            if on_batch:
                on_batch(len(chunk), n)
    finally:
        tok.encode_special_tokens = prev
