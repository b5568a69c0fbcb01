"""A model and a llama.cpp context built from llama-cpp-python's low-level API, for what `Llama` does not expose.

`Llama` builds its one context inside its constructor from the arguments it knows. The benchmarks need
llama-perplexity's context (several sequences in one unified KV cache, several adapters to switch between) and the
routing view needs llama.cpp's evaluation callback on the graph's tensors; `llama_context` gives either, with what
every verb applies anyway: the header checked, each adapter checked before llama.cpp sees it, no weight repacking on
AMX CPUs, integer metadata overrides (`--override-kv KEY=int:V`).

Example:
    >>> with llama_context(Path("model.gguf"), n_ctx=512, n_batch=512) as lc:
    ...     llama_cpp.llama_decode(lc.ctx.ctx, batch)
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from mfgguf.errors import MfggufError

UBATCH = 512  # llama.cpp's default micro-batch


@dataclass
class Loaded:
    model: object  # llama_cpp._internals.LlamaModel
    ctx: object  # llama_cpp._internals.LlamaContext
    header: dict  # runtime/llm.py read_header's facts
    n_batch: int
    adapters: dict[str, object] = field(default_factory=dict)  # name -> llama_adapter_lora_p


@contextmanager
def llama_context(model: Path, *, n_ctx: int, n_batch: int, n_seq: int = 1, kv_unified: bool = False,
                  threads: int | None = None, adapters: dict[str, Path] | None = None,
                  overrides: dict[str, int] | None = None, cb_eval=None, model_of=None):
    """`Loaded` for a `with` block: MODEL, a context of `n_ctx` tokens over `n_seq` sequences (`kv_unified`: one
    cache for all), every adapter of `adapters` loaded (none applied), `overrides` applied at load, `cb_eval` (a
    llama_cpp.ggml_backend_sched_eval_callback, kept alive by the caller) on every graph the context computes.
    `model_of` (an open `Llama` of MODEL) lends its loaded weights to the new context instead of loading them again."""
    import llama_cpp
    from llama_cpp._internals import LlamaContext, LlamaModel

    from mfgguf.gguf.lora import check_adapter
    from mfgguf.runtime import repack
    from mfgguf.runtime.llm import quiet_llama_logs, read_header

    header = read_header(model)
    for a in (adapters or {}).values():
        if not Path(a).is_file():
            raise MfggufError(f"LoRA adapter not found: {a}; pass the lora.gguf that `mfgguf train-base --mode lora` wrote")
        check_adapter(Path(a), Path(header["path"]))
    quiet_llama_logs(False)
    if model_of is not None:
        m = model_of._model
    else:
        repack.apply()  # wraps llama_model_default_params: no repacking on AMX CPUs, as every other verb
        mp = llama_cpp.llama_model_default_params()
        kvo = _overrides(overrides or {})  # alive until the model is loaded
        if kvo is not None:
            mp.kv_overrides = kvo
        m = LlamaModel(path_model=str(header["path"]), params=mp, verbose=False)
    loaded = {}
    try:
        for name, a in (adapters or {}).items():
            ptr = llama_cpp.llama_adapter_lora_init(m.model, str(a).encode("utf-8"))
            if ptr is None:
                raise MfggufError(f"llama.cpp could not load the LoRA adapter {a}; pass one made for {header['path']}")
            loaded[name] = ptr
        cp = llama_cpp.llama_context_default_params()
        cp.n_ctx = n_ctx
        cp.n_batch = min(n_batch, n_ctx)
        cp.n_ubatch = UBATCH  # llama.cpp itself bounds it by n_batch
        cp.n_seq_max = n_seq
        cp.kv_unified = kv_unified
        cp.n_threads = cp.n_threads_batch = threads or os.cpu_count()
        cp.flash_attn_type = llama_cpp.LLAMA_FLASH_ATTN_TYPE_AUTO  # llama.cpp's programs' default: it decides
        if cb_eval is not None:
            cp.cb_eval = cb_eval
        c = LlamaContext(model=m, params=cp, verbose=False)
        try:
            yield Loaded(m, c, header, int(cp.n_batch), loaded)
        finally:
            c.close()
    finally:
        for ptr in loaded.values():
            llama_cpp.llama_adapter_lora_free(ptr)
        if model_of is None:
            m.close()


def _overrides(values: dict[str, int]):
    """llama.cpp's kv-override array (its last entry empty, the end marker) for integer values; None for none."""
    import llama_cpp

    if not values:
        return None
    arr = (llama_cpp.llama_model_kv_override * (len(values) + 1))()
    for i, (k, v) in enumerate(values.items()):
        arr[i].key = k.encode("utf-8")
        arr[i].tag = llama_cpp.LLAMA_KV_OVERRIDE_TYPE_INT
        arr[i].value.val_i64 = int(v)
    return arr


__all__ = ["Loaded", "UBATCH", "llama_context"]
