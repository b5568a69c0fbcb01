"""The `study` corpus: five real text domains, tens of millions of tokens, from what installs here.

The built-in corpus (~1.5M tokens) is too small to train a trunk to where its held-out loss
flattens without seeing tokens many times. `study` reads what a fresh machine has after the
project's own set-up, nothing from a hub:

  python   code of the installed packages and the standard library (one half of the .py files)
  english  docstrings of the other half, plus pydoc's topics (prose, not code)
  c        C headers of the distribution (/usr/include) and CPython's
  cpp      C++ headers that ship with the installed packages (torch's ATen/c10/...; .hpp, .cuh)
  man      manual pages of the distribution, roff markup stripped to text

Files are read in a fixed pseudo-random order (so a capped domain samples the whole tree) and
each domain is capped by `prepare --max-chars-per-domain`. On this project's set-up (torch,
numpy, llama-cpp-python... in the venv, a Debian-like base image) every domain holds tens of MB of
text or more; the study's capped sizes are in docs/results/README.md.

Example:
    >>> mfgguf prepare STUDY --source study --max-chars-per-domain 30000000 --partition label
"""

from __future__ import annotations

import gzip
import hashlib
import os
import re
import sysconfig
from pathlib import Path
from typing import Iterable, Iterator

from mfgguf.data.texts import docstrings, file_texts

STUDY = "study"
STUDY_DOMAINS = ("python", "english", "c", "cpp", "man")
_SKIP = {"__pycache__", ".git", "node_modules", "test", "tests", "testing"}
_MAN_DIRS = ("/usr/share/man", "/usr/local/share/man")
_C_DIRS = ("/usr/include", "/usr/local/include")


def study_texts(full=lambda domain: False, label: str | None = None) -> Iterator[tuple[str, str]]:
    """(domain, text) pairs of the study corpus, domain by domain in STUDY_DOMAINS order.

    `full(domain)` stops a domain once its budget is spent (prepare's per-domain cap).
    """
    code, prose = _python_halves()
    streams = {
        "python": lambda: (("python", t) for t in file_texts(code)),
        "english": lambda: (("english", t) for t in _english(prose, docstrings)),
        "c": lambda: (("c", t) for t in file_texts(_c_headers())),
        "cpp": lambda: (("cpp", t) for t in file_texts(_cpp_headers())),
        "man": lambda: (("man", t) for t in _man_texts()),
    }
    for domain in STUDY_DOMAINS:
        for item in streams[domain]():
            if full(label or domain):
                break
            yield item


def _key(salt: str, p: Path) -> str:
    return hashlib.sha1((salt + p.as_posix()).encode()).hexdigest()


def _walk(roots: Iterable[str | Path], suffixes: tuple[str, ...]) -> list[Path]:
    out = []
    for root in roots:
        if not os.path.isdir(root):
            continue
        for d, dirs, names in os.walk(root):
            dirs[:] = sorted(x for x in dirs if x not in _SKIP and not x.startswith("."))
            out += [Path(d) / n for n in sorted(names) if n.endswith(suffixes)]
    return sorted(set(out))


def _python_halves() -> tuple[list[Path], list[Path]]:
    """The installed .py files split by a hash into (code half, docstring half), each in spread order:
    a held-out python document is never the source of an english training docstring, or back."""
    paths = sysconfig.get_paths()
    files = _walk(dict.fromkeys([paths["purelib"], paths["platlib"], paths["stdlib"]]), (".py",))
    code = [p for p in files if int(_key("half", p)[:8], 16) % 2 == 0]
    prose = [p for p in files if int(_key("half", p)[:8], 16) % 2 == 1]
    return sorted(code, key=lambda p: _key("python", p)), sorted(prose, key=lambda p: _key("english", p))


def _english(py_files: list[Path], docstrings) -> Iterator[str]:
    try:
        from pydoc_data.topics import topics
    except ImportError:
        topics = {}
    yield from (topics[k] for k in sorted(topics))
    yield from docstrings(py_files)


def _c_headers() -> list[Path]:
    inc = sysconfig.get_paths().get("include")
    files = _walk([*_C_DIRS, *([inc] if inc else [])], (".h",))
    files = [p for p in files if "c++" not in p.parts]  # libstdc++'s headers are C++
    return sorted(files, key=lambda p: _key("c", p))


def _cpp_headers() -> list[Path]:
    paths = sysconfig.get_paths()
    roots = [Path(paths["purelib"]), *[Path(d) for d in _C_DIRS]]
    files = []
    for root in roots:
        for p in _walk([root], (".h", ".hpp", ".hh", ".cuh", ".cpp", ".cc", ".hxx")):
            rel = p.relative_to(root).parts
            # C++: anything under a site-packages include/ tree (torch's ATen, c10, ...), or libstdc++
            if (root.name.endswith("-packages") and "include" in rel) or "c++" in rel or p.suffix != ".h":
                files.append(p)
    return sorted(set(files), key=lambda p: _key("cpp", p))


# ---- manual pages ---------------------------------------------------------------------------------

_ROFF_ESC = re.compile(r"\\f(\[[^\]]*\]|\(..|.)|\\\*(\(..|.)|\\[&|^%:,/0ce]|\\s[+-]?\d+")
_ROFF_CHARS = {r"\(em": "--", r"\(en": "-", r"\(bu": "*", r"\(aq": "'", r"\(dq": '"', r"\(lq": '"', r"\(rq": '"',
               r"\(co": "(c)", r"\-": "-", r"\e": "\\", r"\ ": " ", r"\~": " "}
_KEEP_MACROS = {"SH", "SS", "B", "I", "BR", "IR", "RB", "RI", "BI", "IB", "TP", "IP", "Nm", "Nd", "Sh", "Ss", "Fl",
                "Ar", "Op", "Pa", "Xr", "It", "Em", "Dq", "Sq", "Ql", "Cm", "Ev", "Va", "Fn", "Ft"}


def roff_to_text(src: str) -> str:
    """Manual-page source to plain text: requests dropped, font and character escapes resolved.

    Example:
        >>> roff_to_text('.SH NAME\\nls \\\\- list \\\\fBdirectory\\\\fR contents')
        'NAME\\nls - list directory contents\\n'
    """
    out = []
    for line in src.splitlines():
        if line.startswith((".\\\"", "'\\\"", '.\\"')):
            continue  # comment
        if line.startswith((".", "'")):
            parts = line[1:].split(None, 1)
            if not parts or parts[0] not in _KEEP_MACROS:
                continue
            line = parts[1] if len(parts) > 1 else ""
            line = line.replace('"', "")
        for k, v in _ROFF_CHARS.items():
            line = line.replace(k, v)
        line = _ROFF_ESC.sub("", line).replace("\\", "")
        if line.strip():
            out.append(line)
    return "\n".join(out) + "\n" if out else ""


def _man_texts() -> Iterator[str]:
    files = _walk(_MAN_DIRS, (".gz", ".1", ".2", ".3", ".4", ".5", ".6", ".7", ".8"))
    roots = {Path(d) for d in _MAN_DIRS}  # English pages only: <root>/manN/, not <root>/de/manN/
    files = [p for p in files if p.parent.parent in roots and re.fullmatch(r"man[1-9]\w*", p.parent.name)]
    for p in sorted(files, key=lambda p: _key("man", p)):
        try:
            raw = gzip.decompress(p.read_bytes()) if p.suffix == ".gz" else p.read_bytes()
            text = roff_to_text(raw.decode("utf-8"))
        except (OSError, UnicodeDecodeError, EOFError, gzip.BadGzipFile):
            continue
        if len(text) >= 200:  # skip `.so` redirections and stubs
            yield text
