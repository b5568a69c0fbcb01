"""An imported base as the rest of the pipeline sees it: RUN/base/ (see importer.py).

  - `prepare` into a RUN that holds one tokenizes with the base's tokenizer (tokenizer.json with
    `tokenizers`, or llama.cpp's own tokenizer on vocab.gguf for a GGUF-only base), ends documents
    with the base's EOS, and keeps the imported trunk;
  - the assembler writes the base's tokenizer keys (tokens, merges, types, special tokens, chat
    template: every `tokenizer.*` key) and context length, copied from vocab.gguf unchanged.

Torch-free: the assembler imports it.
"""

from __future__ import annotations

import functools
import shutil
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

from mfgguf.errors import MfggufError

BASE_FORMAT = "mfgguf-base"


@dataclass(frozen=True)
class BaseFiles:
    """Paths of RUN/base/ for a RUN root."""

    run: Path

    @property
    def root(self) -> Path: return Path(self.run) / "base"
    @property
    def info(self) -> Path: return self.root / "base.json"
    @property
    def vocab(self) -> Path: return self.root / "vocab.gguf"
    @property
    def tokenizer_json(self) -> Path: return self.root / "tokenizer.json"

    def special_id(self, kind: str) -> int | None:
        v = self._header().value(f"tokenizer.ggml.{kind}_token_id")
        return None if v is None else int(v)

    def value(self, key: str, default=None):
        """One key-value of vocab.gguf (`tokenizer.chat_template`, `tokenizer.ggml.token_type`...), or `default`."""
        return self._header().value(key, default)

    def token(self, i: int) -> str:
        return self._header().value("tokenizer.ggml.tokens")[i]

    def _header(self):
        return _vocab_header(self.vocab, self.vocab.stat().st_mtime_ns)  # parsed once a version of the file

    def gguf_kv(self) -> tuple[list[tuple[str, str, object]], int, int]:
        """(every tokenizer.* key-value of the base, as layout.header_parts takes them; its vocabulary size;
        the base's context length)."""
        return _vocab_kv(self.vocab, self.vocab.stat().st_mtime_ns)


@functools.lru_cache(maxsize=4)
def _vocab_header(path: Path, mtime_ns: int):
    """The header of one vocab.gguf version. Our own parser, not gguf-py's reader: that one builds numpy views
    item by item, seconds for a real base's vocabulary on every read (docs/benchmarks.md)."""
    from mfgguf.gguf.header import read_gguf_header

    return read_gguf_header(path)


@functools.lru_cache(maxsize=4)
def _vocab_kv(path: Path, mtime_ns: int) -> tuple[list[tuple[str, str, object]], int, int]:
    """gguf_kv of one vocab.gguf version."""
    h = _vocab_header(path, mtime_ns)
    kv = [(k, t, v) for k, t, v in h.kv if k.startswith("tokenizer.")]
    return kv, len(h.value("tokenizer.ggml.tokens")), int(h.value(f"{h.value('general.architecture')}.context_length"))


def imported(run: Path) -> BaseFiles | None:
    """RUN/base/ when `mfgguf import-base` wrote RUN, else None."""
    files = BaseFiles(Path(run))
    return files if files.info.is_file() else None


def base_only(run: Path) -> bool:
    """RUN holds an imported base and nothing prepared yet: `prepare` may fill it without --force."""
    return imported(run) is not None and not (Path(run) / "run.json").exists()


def base_info(files: BaseFiles) -> dict:
    from mfgguf.run import read_json

    return read_json(files.info, "the imported base's description")


def base_tokenizer(files: BaseFiles):
    """The base's tokenizer, with the interface data/tokenizer.encode_documents uses."""
    if files.tokenizer_json.is_file():
        from tokenizers import Tokenizer

        return Tokenizer.from_file(str(files.tokenizer_json))
    return LlamaCppTokenizer(files.vocab)


class LlamaCppTokenizer:
    """llama.cpp's tokenizer of a vocab-only GGUF, shaped like a `tokenizers.Tokenizer` for encode_documents.

    Text that spells a special token is tokenized as plain text (special=False), as prepare does
    with `tokenizers` (encode_special_tokens=True), and no BOS is added: prepare adds the EOS. With
    encode_special_tokens False (a chat template's own text) special tokens are parsed, as `tokenizers` does.
    """

    def __init__(self, vocab: Path):
        import llama_cpp

        try:
            self.llm = llama_cpp.Llama(model_path=str(vocab), vocab_only=True, verbose=False)
        except Exception as e:  # llama-cpp-python raises ValueError on a file it cannot load
            raise MfggufError(f"llama.cpp cannot load the base's vocabulary {vocab} ({e})") from None
        self.encode_special_tokens = True

    def get_vocab_size(self) -> int:
        return self.llm.n_vocab()

    def encode_batch(self, texts: list[str], add_special_tokens: bool = False):
        return [SimpleNamespace(ids=self.llm.tokenize(t.encode("utf-8"), add_bos=False,
                                                      special=not self.encode_special_tokens)) for t in texts]


def carry_into(files: BaseFiles, tmp_run: Path) -> None:
    """Copy the base (RUN/base/) and its trunk module (+ manifest entry) into a RUN being prepared at `tmp_run`."""
    from mfgguf.run import RunDir, read_module, update_manifest

    src, dst = RunDir(files.run), RunDir(tmp_run)
    shutil.copytree(files.root, BaseFiles(tmp_run).root)
    if src.module_file(0).is_file():
        meta = read_module(src, 0)
        if meta.source != "base":
            return  # a trunk trained since: it belongs to the old data, not to the base
        dst.modules.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src.module_file(0), dst.module_file(0))
        shutil.copy2(src.module_meta(0), dst.module_meta(0))
        update_manifest(dst, 0, meta)
