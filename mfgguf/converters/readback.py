"""Re-read a written GGUF with the parser llama.cpp uses and check it against the plan it was written from.

The parser is llama.cpp's own (gguf_init_from_file in libggml-base, header only, through ctypes),
falling back to gguf-py's GGUFReader where that library is unavailable or MFGGUF_VERIFY=gguf-py.

Example:
    >>> verify(plan, Path("model.gguf"))  # raises AssertionError on any difference
    >>> infos, data_offset, arch = read_back(Path("model.gguf"))
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

from mfgguf.converters.plan.layout import Plan
from mfgguf.converters.quant import ggml_lib
from mfgguf.gguf.schema import QTYPES


def verify(p: Plan, path: Path) -> None:
    """Re-read the written file: size, then every tensor's name, type, size and offset, and the arch.

    The parser is llama.cpp's own (gguf_init_from_file in libggml-base, header only), falling back
    to gguf-py's GGUFReader where that library is unavailable (slower: it builds one numpy view per
    token string).
    """
    size = os.path.getsize(path)
    if size != p.total_size:
        raise AssertionError(f"written file is {size} bytes, the layout says {p.total_size}")
    infos, data_offset, arch = read_back(path)
    if len(infos) != len(p.slots):
        raise AssertionError(f"re-read {len(infos)} tensors, wrote {len(p.slots)}")
    if data_offset != p.data_offset or arch != p.arch:
        raise AssertionError(f"re-read data offset {data_offset} / arch {arch}, wrote {p.data_offset} / {p.arch}")
    for (name, ggml_type, nbytes, offset), s in zip(infos, p.slots):
        if (name, ggml_type, nbytes, offset) != (s.name, QTYPES[s.qtype].ggml, s.nbytes, s.offset):
            raise AssertionError(f"re-read tensor {name} differs from the layout of {s.name}")


def read_back(path: Path) -> tuple[list[tuple[str, int, int, int]], int, str]:
    """[(name, ggml type, bytes, offset in data)], data offset, architecture, as a reader parses them."""
    lib = ggml_lib()
    if lib is None or os.environ.get("MFGGUF_VERIFY") == "gguf-py":
        import gguf

        r = gguf.GGUFReader(path)
        f = r.fields["general.architecture"]
        d0 = r.tensors[0].data_offset if r.tensors else 0
        infos = [(t.name, int(t.tensor_type), int(t.n_bytes), int(t.data_offset) - d0) for t in r.tensors]
        return infos, d0, bytes(f.parts[f.data[0]]).decode()

    class Params(ctypes.Structure):
        _fields_ = [("no_alloc", ctypes.c_bool), ("ctx", ctypes.c_void_p)]

    vp, i64 = ctypes.c_void_p, ctypes.c_int64
    for fn, res, args in (("gguf_init_from_file", vp, [ctypes.c_char_p, Params]), ("gguf_free", None, [vp]),
                          ("gguf_get_n_tensors", i64, [vp]), ("gguf_get_tensor_name", ctypes.c_char_p, [vp, i64]),
                          ("gguf_get_tensor_offset", ctypes.c_size_t, [vp, i64]), ("gguf_get_tensor_type", ctypes.c_int, [vp, i64]),
                          ("gguf_get_tensor_size", ctypes.c_size_t, [vp, i64]), ("gguf_get_data_offset", ctypes.c_size_t, [vp]),
                          ("gguf_find_key", i64, [vp, ctypes.c_char_p]), ("gguf_get_val_str", ctypes.c_char_p, [vp, i64])):
        getattr(lib, fn).restype, getattr(lib, fn).argtypes = res, args
    ctx = lib.gguf_init_from_file(str(path).encode(), Params(True, None))
    if not ctx:
        raise AssertionError(f"llama.cpp's GGUF parser rejected {path}")
    try:
        n = lib.gguf_get_n_tensors(ctx)
        infos = [(lib.gguf_get_tensor_name(ctx, i).decode(), lib.gguf_get_tensor_type(ctx, i),
                  lib.gguf_get_tensor_size(ctx, i), lib.gguf_get_tensor_offset(ctx, i)) for i in range(n)]
        key = lib.gguf_find_key(ctx, b"general.architecture")
        arch = lib.gguf_get_val_str(ctx, key).decode() if key >= 0 else ""
        return infos, lib.gguf_get_data_offset(ctx), arch
    finally:
        lib.gguf_free(ctx)
