"""Where the ggml libraries llama-cpp-python installs are: found via importlib, without importing llama_cpp.

quant.py loads `libggml-base` from here (ggml's quantizer, llama.cpp's GGUF parser) and fastquant.py
loads `libggml-cpu` beside it (the vectorised q8_0 row quantizer).

Example:
    >>> base_path()  # e.g. .../site-packages/llama_cpp/lib/libggml-base.so, or None
"""

from __future__ import annotations

import importlib.util
from pathlib import Path


def base_path() -> Path | None:
    """The installed libggml-base, or None when llama-cpp-python (or its library) is absent."""
    spec = importlib.util.find_spec("llama_cpp")
    if spec is None or spec.origin is None:
        return None
    lib = Path(spec.origin).parent / "lib"
    for name in ("libggml-base.so", "libggml-base.dylib", "ggml-base.dll"):
        if (lib / name).exists():
            return lib / name
    return None
