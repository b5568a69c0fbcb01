"""The built-in corpus: what needs nothing but Python itself.

Three domains, read from the running interpreter's installation: the standard library's source
code (`python`), its English documentation and docstrings (`english`) and CPython's C headers
(`c`). Files are visited in a fixed pseudo-random order, so a capped domain samples the whole tree.

Example:
    >>> domain, text = next(builtin_texts())  # ("python", "...source of one stdlib module...")
"""

from __future__ import annotations

import hashlib
import os
import sysconfig
from pathlib import Path
from typing import Iterator

from mfgguf.data.texts import SKIP_DIRS, docstrings, file_texts

BUILTIN = "builtin"
BUILTIN_DOMAINS = ("python", "english", "c")


def builtin_texts(full=lambda domain: False, label: str | None = None) -> Iterator[tuple[str, str]]:
    """(domain, text) pairs of the built-in corpus, in a fixed order, domain by domain.

    `full(domain)` lets the caller stop reading a domain early once its budget is spent.
    """
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    py_files = _stdlib_py_files(stdlib)
    streams = {
        "python": (("python", t) for t in file_texts(py_files)),
        "english": _english_texts(py_files),
        "c": (("c", t) for t in file_texts(_header_files())),
    }
    for domain in BUILTIN_DOMAINS:
        for item in streams[domain]:
            if full(label or domain):
                break
            yield item


def _spread(paths: list[Path], root: Path, salt: str) -> list[Path]:
    """A fixed pseudo-random order, so that a capped domain samples the whole tree, not just 'a*'."""
    key = lambda p: hashlib.sha1((salt + p.relative_to(root).as_posix()).encode()).hexdigest()
    return sorted(paths, key=key)


def _stdlib_py_files(stdlib: Path) -> list[Path]:
    skip = SKIP_DIRS | {"test", "tests", "idle_test", "site-packages", "dist-packages", "pydoc_data", "encodings"}
    files = []
    for root, dirs, names in os.walk(stdlib):
        dirs[:] = sorted(d for d in dirs if d not in skip and not d.startswith("."))
        files += [Path(root) / n for n in sorted(names) if n.endswith(".py")]
    return _spread(files, stdlib, "python")


def _header_files() -> list[Path]:
    inc = sysconfig.get_paths().get("include")
    if not inc or not os.path.isdir(inc):
        return []  # no CPython headers on this machine: the `c` domain is simply absent
    return sorted(Path(inc).rglob("*.h"))


def _english_texts(py_files: list[Path]) -> Iterator[tuple[str, str]]:
    """pydoc topics interleaved with module docstrings, so a capped domain gets some of each."""
    try:
        from pydoc_data.topics import topics
    except ImportError:
        topics = {}
    streams = [(topics[k] for k in sorted(topics)), docstrings(py_files[::-1])]  # reversed: other files than `python`
    while streams:
        for it in list(streams):
            item = next(it, None)
            if item is None:
                streams.remove(it)
            else:
                yield "english", item
