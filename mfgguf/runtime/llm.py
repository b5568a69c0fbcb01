"""Open a GGUF with llama-cpp-python, after checking it is one we can run.

Every runtime verb (chat, generate, serve, perplexity) goes through here, so bad input fails the
same way everywhere: one MfggufError line before llama.cpp is touched (llama.cpp itself only
says "failed to load model"). Weight repacking follows `repack.py` (off on AMX CPUs, where
llama.cpp's repacked matmul crashes). The model is always closed explicitly: llama-cpp-python prints a
traceback from `Llama.__del__` at interpreter exit otherwise.

Example:
    >>> from mfgguf.runtime.llm import loaded
    >>> with loaded("model.gguf") as llm:
    ...     print(llm.tokenize(b"hello"))
"""

from __future__ import annotations

import ctypes
import os
import sys
from contextlib import contextmanager
from pathlib import Path

from mfgguf.errors import MfggufError, Outdated
from mfgguf.gguf.lora import check_adapter

def _written_archs() -> tuple[str, ...]:
    from mfgguf.families import written_archs

    return written_archs()


SUPPORTED_ARCHS = _written_archs()  # what `mfgguf assemble` writes
GGUF_MAGIC = b"GGUF"


def read_header(path: Path) -> dict:
    """Check that `path` is a GGUF we can run and return its header facts (no weights loaded).

    Returns {"path", "arch", "context_length", "n_vocab", "name", "chat_template", "experts" (their labels),
    "experts_per_token", "n_experts" (None for a dense file)}. Raises
    MfggufError for a missing file, a file that is not a GGUF, an unreadable GGUF, or an
    architecture `mfgguf assemble` does not write (SUPPORTED_ARCHS).
    """
    path = Path(path)
    if not path.exists():
        raise MfggufError(f"model file not found: {path}; pass the path of a .gguf written by `mfgguf assemble`")
    if not path.is_file():
        raise MfggufError(f"{path} is not a file; pass the path of a .gguf written by `mfgguf assemble`")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise MfggufError(f"{path} is not a GGUF file (it does not start with 'GGUF'); pass a .gguf written by `mfgguf assemble`")
    from mfgguf.gguf.header import read_gguf_header

    try:  # our parser, not gguf-py's reader: that one takes seconds over a real base's vocabulary on every load
        h = read_gguf_header(path)
        short = h.tensors_end() > h.size
    except Outdated:
        raise
    except (MfggufError, ValueError) as e:  # ValueError: a tensor type ggml does not have
        raise MfggufError(f"{path} is a damaged GGUF: {str(e).removeprefix(f'{path} ')}; re-create it with `mfgguf assemble`") from None
    if short:
        raise MfggufError(f"{path} is a damaged GGUF: its tensors end past the file's {h.size:,} bytes (truncated);"
                          " re-create it with `mfgguf assemble`")
    field = h.value
    arch = field("general.architecture")
    if arch not in SUPPORTED_ARCHS:
        raise MfggufError(
            f"{path} has architecture {arch!r}; mfgguf runs {', '.join(SUPPORTED_ARCHS)} GGUFs"
            " (the ones `mfgguf assemble` writes); use llama.cpp directly for other models"
        )
    n_ctx = field(f"{arch}.context_length")
    if not n_ctx:
        raise MfggufError(f"{path} lacks {arch}.context_length; re-create it with `mfgguf assemble`")
    tokens = field("tokenizer.ggml.tokens")
    return {
        "path": path,
        "arch": arch,
        "context_length": int(n_ctx),
        "n_vocab": len(tokens) if tokens is not None else None,
        "name": field("general.name"),
        "chat_template": field("tokenizer.chat_template"),
        "experts": field("mfgguf.expert_labels") or [],  # each routed expert's label (converters/plan/names.py)
        "experts_per_token": field(f"{arch}.expert_used_count"),
        "n_experts": field(f"{arch}.expert_count"),
    }


def experts_override(header: dict, k: int | None) -> dict:
    """llama.cpp's metadata override for `k` experts a token ({} for None: the file's own), checked against the
    file: {"ARCH.expert_used_count": k}, what llama.cpp's programs take as `--override-kv ARCH.expert_used_count=int:K`."""
    if k is None:
        return {}
    n = header.get("n_experts")
    if not n:
        raise MfggufError(f"{header['path']} has no routed experts; --experts-per-token is for a MoE file")
    if not 1 <= k <= n:
        raise MfggufError(f"--experts-per-token {k} is out of range; {header['path'].name} has {n} experts, pass 1..{n}")
    return {f"{header['arch']}.expert_used_count": int(k)}


def check_ctx(header: dict, n_ctx: int | None) -> int:
    """The context to use: the model's trained context by default; never longer than it."""
    trained = header["context_length"]
    if n_ctx is None:
        return trained
    if n_ctx < 2:
        raise MfggufError(f"--ctx {n_ctx} is too small; pass at least 2 (the model was trained on {trained})")
    if n_ctx > trained:
        raise MfggufError(
            f"--ctx {n_ctx} is longer than the model's trained context of {trained} tokens; pass --ctx {trained} or less"
        )
    return n_ctx


_log_cb = None  # keep the ctypes callback alive for as long as the library may call it


def quiet_llama_logs(verbose: bool) -> None:
    """Route llama.cpp's log to stderr only for errors (or everything when verbose).

    llama-cpp-python maps ggml's log levels with an old table, so with verbose=False it still
    prints warnings such as llama.cpp's note that it padded the context to 256.
    """
    global _log_cb
    import llama_cpp

    @llama_cpp.llama_log_callback
    def cb(level, text, user_data):
        if verbose or level == 4:  # GGML_LOG_LEVEL_ERROR in this llama.cpp
            sys.stderr.write(text.decode("utf-8", "replace"))

    llama_cpp.llama_log_set(cb, ctypes.c_void_p(0))
    _log_cb = cb  # only now may the previous callback be freed


def open_model(
    path: Path,
    *,
    n_ctx: int | None = None,
    seed: int = 0,
    logits_all: bool = False,
    n_batch: int | None = None,
    threads: int | None = None,
    verbose: bool = False,
    lora: Path | None = None,
    flash_attn: bool = False,
    experts_per_token: int | None = None,
):
    """Validate a GGUF and load it with llama-cpp-python; the caller must `close()` it.

    n_ctx defaults to the model's trained context (a longer one is an error). `lora` is a llama.cpp
    LoRA adapter GGUF of this model (`train-base --mode lora` writes one) applied at scale 1.
    `flash_attn` turns on llama.cpp's fused attention, as llama.cpp's own tools do on a CPU by default
    (llama-cpp-python's default is off): faster over long windows, with log-probabilities that differ
    in about the fifth digit, so it is for scoring, where the windows are long. `experts_per_token` routes each
    token to that many experts instead of the file's own count, by llama.cpp's metadata override (no rewrite).
    Prefer `loaded(...)`, which closes the model for you.

    Example:
        >>> llm = open_model("model.gguf", n_ctx=128)
        >>> try: print(llm("The", max_tokens=8)["choices"][0]["text"])
        ... finally: llm.close()
    """
    header = read_header(path)
    n_ctx = check_ctx(header, n_ctx)
    overrides = experts_override(header, experts_per_token)
    if lora is not None:
        if not Path(lora).is_file():
            raise MfggufError(f"LoRA adapter not found: {lora}; pass the lora.gguf that `mfgguf train-base --mode lora` wrote")
        check_adapter(Path(lora), Path(header["path"]))
    import llama_cpp

    from mfgguf.runtime import repack

    quiet_llama_logs(verbose)
    decision = repack.apply()  # no weight repacking on AMX CPUs: llama.cpp's AMX matmul crashes
    if verbose:
        print(f"mfgguf: {decision.reason}", file=sys.stderr)
    try:
        llm = llama_cpp.Llama(
            model_path=str(header["path"]),
            n_ctx=n_ctx,
            n_batch=n_batch or min(n_ctx, 512),
            n_ubatch=min(n_batch or n_ctx, 512),  # llama.cpp's default micro-batch
            n_threads=threads or os.cpu_count(),
            n_threads_batch=threads or os.cpu_count(),
            seed=seed,
            logits_all=logits_all,
            verbose=verbose,
            lora_path=str(lora) if lora is not None else None,
            flash_attn=flash_attn,
            kv_overrides=overrides or None,
        )
    except ValueError as e:  # llama.cpp rejected the file although the header looked right
        raise MfggufError(f"llama.cpp could not load {header['path']} ({e}); re-create it with `mfgguf assemble`") from None
    llm.mfgguf_header = header  # facts the verbs need (trained context, arch) without re-reading
    llm.mfgguf_n_ctx = n_ctx  # llama.cpp pads its context to 256; this is the one we promised
    llm.mfgguf_repack = decision.repack
    if overrides:
        llm.mfgguf_header = {**header, "experts_per_token": experts_per_token}
    return llm


@contextmanager
def loaded(path: Path, **kw):
    """`open_model(path, **kw)` as a context manager that always closes the model.

    Example:
        >>> with loaded("model.gguf", seed=1) as llm:
        ...     text = llm("Once", max_tokens=16)["choices"][0]["text"]
    """
    llm = open_model(path, **kw)
    try:
        yield llm
    finally:
        llm.close()
