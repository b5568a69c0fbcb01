"""q8_0 with ggml's vectorised row quantizer: several times the reference quantizer's speed, not byte-identical to it.

`ggml_quantize_chunk` (quant.py, and every llama.cpp tool that writes q8_0: convert_hf_to_gguf via
gguf-py, llama-quantize) runs ggml's scalar reference quantizer, which makes q8_0 assembly CPU-bound at several times plain I/O. ggml-cpu also has
the vectorised `quantize_row_q8_0` (AVX2/AVX-512/NEON; llama.cpp quantizes every activation with
it at inference), reached through `ggml_get_type_traits_cpu(GGML_TYPE_Q8_0)->from_float`: several times
faster per core (docs/assembly.md). Same format, same scale per block; it computes the inverse scale as 127/amax
instead of 1/(amax/127) and rounds halves to even, so a few bytes per million differ from the
reference by one quantization step. `assemble
--fast-quant` uses it; the default stays byte-identical to llama.cpp's own converter.

Example:
    >>> q = quantize_q8_0(np.ones((4, 64), np.float32))  # None where libggml-cpu is unavailable
"""

from __future__ import annotations

import ctypes
import os

import numpy as np

from mfgguf.converters.ggmllib import base_path

GGML_TYPE_Q8_0 = 8
_FN: list = []


class _Traits(ctypes.Structure):  # struct ggml_type_traits_cpu (ggml-cpu.h)
    _fields_ = [("from_float", ctypes.c_void_p), ("vec_dot", ctypes.c_void_p), ("vec_dot_type", ctypes.c_int),
                ("nrows", ctypes.c_int64)]


def _from_float():
    """ggml-cpu's from_float for q8_0 as a ctypes function (it drops the GIL), or None."""
    if not _FN:
        _FN.append(None)
        base = base_path()
        if base is not None and os.environ.get("MFGGUF_NO_GGML") != "1":
            for name in ("libggml-cpu.so", "libggml-cpu.dylib", "ggml-cpu.dll"):
                if not (base.parent / name).exists():
                    continue
                try:
                    lib = ctypes.CDLL(str(base.parent / name))
                    lib.ggml_cpu_init()  # fp16 tables and feature detection
                    lib.ggml_get_type_traits_cpu.restype = ctypes.POINTER(_Traits)
                    lib.ggml_get_type_traits_cpu.argtypes = [ctypes.c_int]
                    ptr = lib.ggml_get_type_traits_cpu(GGML_TYPE_Q8_0).contents.from_float
                    if ptr:
                        fn = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64)(ptr)
                        _FN[0] = (lib, fn)  # keep the library loaded
                except (OSError, AttributeError):
                    pass
                break
    return _FN[0][1] if _FN[0] else None


def available() -> bool:
    return _from_float() is not None


def quantize_q8_0(x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray | None:
    """q8_0 bytes of f32 `x` (..., n with n % 32 == 0) as a flat uint8 array, or None if unavailable."""
    fn = _from_float()
    if fn is None:
        return None
    x = np.ascontiguousarray(x, dtype=np.float32)
    if out is None:
        out = np.empty(x.size // 32 * 34, np.uint8)
    fn(x.ctypes.data, out.ctypes.data, x.size)
    return out
