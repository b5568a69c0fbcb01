"""llama.cpp's own programs as `make llama-tools` builds them (scripts/build_llama_tools.py): where they are.

The folder is `$MFGGUF_LLAMA_TOOLS`, else `<cache>/llama-tools-<llama-cpp-python's version>/bin` (the cache of
mfgguf.base.known); a verb that can use a program (llama-perplexity for benchmarks, llama-server for `serve`)
uses it when it is there and llama-cpp-python otherwise.

Example:
    >>> program("llama-perplexity")          # None where `make llama-tools` has not built it
    PosixPath('/home/me/.cache/mfgguf/llama-tools-0.3.36/bin/llama-perplexity')
"""

from __future__ import annotations

import os
from importlib import metadata
from pathlib import Path

from mfgguf.errors import MfggufError


def tools_dir() -> Path:
    """The folder `make llama-tools` builds into for the llama-cpp-python installed here."""
    if os.environ.get("MFGGUF_LLAMA_TOOLS"):
        return Path(os.environ["MFGGUF_LLAMA_TOOLS"])
    from mfgguf.base.known import cache_dir

    return cache_dir() / f"llama-tools-{metadata.version('llama-cpp-python')}" / "bin"


def program(name: str) -> Path | None:
    """The built program NAME, or None where it is not built."""
    p = tools_dir() / name
    return p if p.is_file() and os.access(p, os.X_OK) else None


def need(name: str) -> Path:
    """The built program NAME, or one line saying how to build it."""
    p = program(name)
    if p is None:
        raise MfggufError(f"llama.cpp's {name} is not built (looked in {tools_dir()}); run `make llama-tools`,"
                          " or leave the engine to choose")
    return p


__all__ = ["need", "program", "tools_dir"]
