"""Quantize f32 rows to GGUF bytes with ggml's own quantizer, so the bytes are llama.cpp's.

`ggml_quantize_chunk` is exported by the `libggml-base` that llama-cpp-python installs next to
its package (`llama_cpp/lib/`, ggmllib.py). We load it with ctypes (found via importlib, without importing
llama_cpp itself) and split the rows over threads: ctypes drops the GIL during the call, so the
threads really run in parallel. Where the library cannot be loaded, gguf-py's numpy quantizers
are the fallback (they write the same bytes for q8_0/q4_0/q5_0/q5_1/bf16/f16; they cannot
write k-quants).

Example:
    >>> import numpy as np
    >>> b = quantize(np.ones((4, 64), np.float32), "q8_0")  # 4 rows x 2 blocks x 34 bytes
    >>> b.nbytes
    272
"""

from __future__ import annotations

import ctypes
import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from mfgguf.errors import MfggufError
from mfgguf.converters.ggmllib import base_path
from mfgguf.gguf.schema import QTYPES

_LIB: ctypes.CDLL | None | bool = None  # None: not tried yet; False: unavailable
_POOLS: dict[int, ThreadPoolExecutor] = {}
MIN_ROWS_PER_THREAD = 16


def ggml_lib():
    """The loaded libggml-base (ctypes), or None when it is not installed or MFGGUF_NO_GGML=1."""
    global _LIB
    if _LIB is None:
        _LIB = False
        path = None if os.environ.get("MFGGUF_NO_GGML") == "1" else base_path()
        if path is not None:
            try:
                lib = ctypes.CDLL(str(path))
                f = lib.ggml_quantize_chunk
                f.restype = ctypes.c_size_t
                f.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                              ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
                _LIB = lib
            except (OSError, AttributeError):
                _LIB = False
    return _LIB or None


def backend() -> str:
    """'ggml' (llama.cpp's quantizer via ctypes) or 'gguf-py' (numpy fallback)."""
    return "ggml" if ggml_lib() is not None else "gguf-py"


def default_threads() -> int:
    return max(1, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)


def _pool(n: int) -> ThreadPoolExecutor:
    if n not in _POOLS:
        _POOLS[n] = ThreadPoolExecutor(n, thread_name_prefix="mfgguf-quant")
    return _POOLS[n]


def quantize(x: np.ndarray, qtype: str, *, threads: int | None = None, out: np.ndarray | None = None,
             fast: bool = False) -> np.ndarray:
    """Quantize an f32 array (..., n_per_row) to a flat uint8 array of GGUF bytes of type `qtype`.

    Rows are quantized independently, so a tensor may be quantized in row chunks and the
    chunks' bytes concatenated. Raises MfggufError when the row length does not fit the block.
    `fast=True` quantizes q8_0 with ggml-cpu's vectorised row quantizer (fastquant.py: several
    times faster, a few bytes per million differ from the reference); other types are unaffected.
    """
    t = QTYPES[qtype]
    x = np.ascontiguousarray(x, dtype=np.float32)
    n_per_row = x.shape[-1] if x.ndim else 1
    if n_per_row % t.block:
        raise MfggufError(f"row length {n_per_row} is not a multiple of {qtype}'s block size {t.block}")
    nrows = x.size // n_per_row if n_per_row else 0
    row_bytes = t.row_bytes(n_per_row)
    if out is None:
        out = np.empty(nrows * row_bytes, dtype=np.uint8)
    if qtype == "f32":
        out[:] = x.reshape(-1).view(np.uint8)
        return out
    if fast and qtype == "q8_0":
        from mfgguf.converters.fastquant import quantize_q8_0

        if quantize_q8_0(x, out) is not None:
            return out
    lib = ggml_lib()
    if lib is None:
        return _quantize_gguf_py(x.reshape(nrows, n_per_row), qtype, out)
    threads = threads or default_threads()
    n_workers = max(1, min(threads, nrows // MIN_ROWS_PER_THREAD))
    src, dst = x.ctypes.data, out.ctypes.data

    def run(r0: int, r1: int) -> int:
        # ggml offsets src by `start` elements and dst by start/n_per_row rows itself
        return lib.ggml_quantize_chunk(t.ggml, src, dst, r0 * n_per_row, r1 - r0, n_per_row, None)

    if n_workers == 1:
        written = run(0, nrows)
    else:
        bounds = np.linspace(0, nrows, n_workers + 1).astype(int)
        written = sum(_pool(n_workers).map(run, bounds[:-1], bounds[1:]))
    assert written == out.nbytes, (written, out.nbytes)
    return out


def _quantize_gguf_py(x: np.ndarray, qtype: str, out: np.ndarray) -> np.ndarray:
    import gguf

    if qtype == "f16":
        out[:] = x.astype(np.float16).reshape(-1).view(np.uint8)
        return out
    if qtype in ("q4_k", "q5_k", "q6_k"):
        raise MfggufError(
            f"{qtype} needs ggml's quantizer (libggml-base from llama-cpp-python), which could not be loaded;"
            " reinstall llama-cpp-python or use --quant q8_0/q4_0"
        )
    q = gguf.quants.quantize(x, gguf.GGMLQuantizationType[qtype.upper()])
    out[:] = q.reshape(-1).view(np.uint8)
    return out


def dequantize(data: np.ndarray, qtype: str, shape: tuple[int, ...]) -> np.ndarray:
    """GGUF bytes of type `qtype` back to f32 of numpy `shape` (gguf-py's dequantizers)."""
    import gguf

    t = gguf.GGMLQuantizationType[qtype.upper()]
    rows = int(np.prod(shape[:-1])) if len(shape) > 1 else 1
    raw = np.asarray(data, dtype=np.uint8).reshape(rows, -1)
    return gguf.quants.dequantize(raw, t).reshape(shape).astype(np.float32)
