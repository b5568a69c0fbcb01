"""Texts of files: a file as UTF-8 text (binary files skipped), a list of files' texts, Python docstrings.

What the built-in corpus (builtin.py), the study corpus (study.py) and file sources (sources.py)
read their documents with.

Example:
    >>> next(file_texts([Path("README.md")]))[:20]
    >>> next(docstrings([Path(ast.__file__)]))[:20]
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Iterable, Iterator

SKIP_DIRS = {"__pycache__", ".git", ".hg", ".svn", ".venv", "node_modules"}  # never corpus text


def read_text(path: Path) -> str | None:
    """The file as UTF-8 text, or None for binary / undecodable / unreadable files."""
    try:
        data = path.read_bytes()
    except OSError:
        return None
    if b"\0" in data[:8192]:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


def file_texts(paths: Iterable[Path]) -> Iterator[str]:
    """The non-blank texts of `paths`, in order (binary and unreadable files skipped)."""
    for p in paths:
        text = read_text(p)
        if text and text.strip():
            yield text


def docstrings(py_files: Iterable[Path]) -> Iterator[str]:
    """Module, class and function docstrings of each file, joined with blank lines."""
    for p in py_files:
        text = read_text(p)
        if not text:
            continue
        try:
            tree = ast.parse(text)
        except (SyntaxError, ValueError):
            continue
        docs = []
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                d = ast.get_docstring(node)
                if d and len(d) >= 40:
                    docs.append(d)
        if docs:
            yield "\n\n".join(docs) + "\n"
