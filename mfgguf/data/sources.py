"""Corpus sources: turn files, directories, globs, JSONL, `datasets` and the built-in corpus into
labelled documents.

Every document keeps a domain label (the file stem, directory name, dataset name, a JSONL
`domain` field, or an explicit `LABEL=SOURCE`), because partitions and held-out evaluation are
per domain. Long texts are cut at line boundaries into documents of at most `MAX_DOC_CHARS`, so
splits work on many small units rather than on a handful of big files.

The built-in corpus (builtin.py) needs nothing but Python itself; the study corpus is study.py.
"""

from __future__ import annotations

import glob
import json
import os
import re
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator

from mfgguf.errors import MfggufError
from mfgguf.data.builtin import BUILTIN, builtin_texts
from mfgguf.data.chat import Conversation, parse_conversation
from mfgguf.data.texts import SKIP_DIRS, read_text

MAX_DOC_CHARS = 8192
STUDY = "study"  # the larger experiment corpus: study.py
_GLOB_CHARS = set("*?[")
_LABEL_RE = re.compile(r"^([A-Za-z0-9_.-]+)=(.+)$")
_HF_FILE_BUILDERS = ("json", "csv", "text", "parquet")


@dataclass(frozen=True)
class Document:
    """One unit of text with its domain label; a conversation (chat.py) keeps its messages, and its text is a plain
    form of them."""

    text: str
    domain: str
    conversation: Conversation | None = None


def load_documents(sources: list[str], *, text_field: str = "text", max_chars_per_domain: int | None = None,
                   progress: bool = True) -> list[Document]:
    """Load labelled documents from SOURCES.

    A source is a text file, a directory (read recursively), a glob (`src/**/*.md`), a JSONL file
    (one object per line with TEXT_FIELD, or a conversation's `messages` list (chat.py), and optionally
    `domain`), `hf:NAME[:CONFIG][:SPLIT]` (a
    `datasets` dataset; `hf:json:data/*.jsonl` reads local files), `builtin` (the Python
    standard library's code, English docs and C headers) or `study` (tens of millions of tokens in
    five domains from the installed packages and the distribution: code, docstrings, C and C++
    headers, man pages; see mfgguf/data/study.py). `LABEL=SOURCE` sets the domain label;
    otherwise it is the file stem, directory or dataset name. Binary and non-UTF-8 files are
    skipped. MAX_CHARS_PER_DOMAIN caps each domain, deterministically.

    Example:
        >>> docs = load_documents(["builtin", "notes=~/notes/**/*.md"], max_chars_per_domain=400_000)
    """
    return load_corpus(sources, text_field=text_field, max_chars_per_domain=max_chars_per_domain,
                       progress=progress)[0]


def load_corpus(sources: list[str], *, text_field: str = "text", max_chars_per_domain: int | None = None,
                progress: bool = True) -> tuple[list[Document], list[dict]]:
    """`load_documents`, also returning per-source statistics (docs, chars, files, skipped)."""
    if not sources:
        raise MfggufError("no sources given; pass files, directories, globs, JSONL, hf:NAME or `builtin`")
    if max_chars_per_domain is not None and max_chars_per_domain < 1:
        raise MfggufError(f"max_chars_per_domain must be positive, got {max_chars_per_domain}")
    cap = _Cap(max_chars_per_domain)
    docs: list[Document] = []
    stats = []
    with _progress(progress) as bar:
        for source in sources:
            task = bar.add_task(f"reading {source}", total=None) if bar else None
            st = {"source": source, "docs": 0, "chars": 0, "files": 0, "skipped": 0}
            for doc in _read_source(source, text_field, st, cap):
                docs.append(doc)
                st["docs"] += 1
                st["chars"] += len(doc.text)
                if bar:
                    bar.update(task, advance=len(doc.text), description=f"reading {source} ({st['docs']} docs)")
            if st["docs"] == 0 and not cap.all_full(st.get("domains", ())):
                if st["skipped"]:
                    raise MfggufError(f"source {source!r} has no readable text ({st['skipped']} binary or non-UTF-8"
                                      " files skipped); point it at UTF-8 text files")
                raise MfggufError(f"source {source!r} contains no text; check the path or pattern")
            st.pop("domains", None)
            stats.append(st)
    if not docs:
        raise MfggufError(f"no documents found in {', '.join(sources)}; check the sources")
    return docs, stats


# ---- one source -------------------------------------------------------------------------------------


def _read_source(source: str, text_field: str, st: dict, cap: "_Cap") -> Iterator[Document]:
    label, spec = None, source
    m = _LABEL_RE.match(source)
    if m and not os.path.exists(source):
        label, spec = sanitize_label(m.group(1)), m.group(2)
    st["domains"] = set()

    def emit(items: Iterable[tuple[str, str]]) -> Iterator[Document]:
        for domain, text in items:
            domain = label or sanitize_label(domain)
            st["domains"].add(domain)
            if isinstance(text, Conversation):  # a whole conversation, never cut
                if cap.take(domain, text.text(), whole=True):
                    yield Document(text.text(), domain, text)
                continue
            for piece in split_text(text):
                piece = cap.take(domain, piece)
                if piece:
                    yield Document(piece, domain)

    if spec == BUILTIN:
        yield from emit(builtin_texts(cap.full, label))
    elif spec == STUDY:
        from mfgguf.data.study import study_texts

        yield from emit(study_texts(cap.full, label))
    elif spec.startswith("hf:"):
        yield from emit(_hf_texts(spec, text_field, label, cap.full))
    else:
        files, default = _expand_path(spec)
        for path in files:
            st["files"] += 1
            if path.suffix == ".jsonl":
                yield from emit(_jsonl_texts(path, text_field, label or default or path.stem))
                continue
            text = read_text(path)
            if text is None:
                st["skipped"] += 1
                continue
            yield from emit([(default or path.stem, text)])


def _expand_path(spec: str) -> tuple[list[Path], str | None]:
    """Files of a path, directory or glob, sorted; and the label they share (None: each file's stem)."""
    expanded = os.path.expanduser(spec)
    if _GLOB_CHARS & set(expanded):
        files = sorted(Path(p) for p in glob.glob(expanded, recursive=True) if os.path.isfile(p))
        if not files:
            raise MfggufError(f"pattern {spec!r} matches no files; check the glob (quote it in the shell)")
        base = expanded[: min(expanded.index(c) for c in _GLOB_CHARS if c in expanded)]
        base_dir = Path(base if base.endswith(os.sep) else os.path.dirname(base) or ".")
        return files, base_dir.resolve().name or "root"
    p = Path(expanded)
    if p.is_dir():
        files = []
        for root, dirs, names in os.walk(p):
            dirs[:] = sorted(d for d in dirs if d not in SKIP_DIRS and not d.startswith("."))
            files += [Path(root) / n for n in sorted(names) if not n.startswith(".")]
        return files, p.resolve().name or "root"
    if p.is_file():
        return [p], None
    if p.exists():
        raise MfggufError(f"source {spec!r} is not a regular file or directory")
    raise MfggufError(f"source {spec!r} does not exist; pass a file, directory, glob, JSONL, hf:NAME or `builtin`")


def _jsonl_texts(path: Path, text_field: str, default: str) -> Iterator[tuple[str, str]]:
    try:
        with open(path, "rb") as f:
            for n, raw in enumerate(f, 1):
                if not raw.strip():
                    continue
                try:
                    obj = json.loads(raw.decode("utf-8"))
                except UnicodeDecodeError:
                    raise MfggufError(f"{path}:{n} is not UTF-8 text") from None
                except ValueError:
                    raise MfggufError(f"{path}:{n} is not valid JSON; each line of a .jsonl file must be one object") from None
                yield _record_text(obj, text_field, default, f"{path}:{n}")
    except OSError as e:
        raise MfggufError(f"cannot read {path}: {e.strerror}") from None


def _record_text(obj, text_field: str, default: str, where: str) -> tuple[str, str | Conversation]:
    if isinstance(obj, dict) and "messages" in obj:  # a conversation: {"messages": [{"role", "content"}, ...]}
        text = parse_conversation(obj["messages"], where)
    elif not isinstance(obj, dict) or text_field not in obj:
        keys = ", ".join(map(str, obj)) if isinstance(obj, dict) else type(obj).__name__
        raise MfggufError(f"{where} has no field {text_field!r} (has: {keys}); pass --text-field, or give a"
                          " conversation a `messages` list")
    else:
        text = obj[text_field]
        if not isinstance(text, str):
            raise MfggufError(f"{where}: field {text_field!r} is {type(text).__name__}, not text")
    domain = obj.get("domain")
    return (str(domain) if domain not in (None, "") else default), text


def _hf_texts(spec: str, text_field: str, label: str | None, full) -> Iterator[tuple[str, str]]:
    """hf:NAME[:CONFIG][:SPLIT], or hf:json:FILES (also csv/text/parquet) for local data files."""
    parts = spec[3:].split(":")
    name = parts[0]
    if not name:
        raise MfggufError(f"source {spec!r} names no dataset; use hf:NAME[:CONFIG][:SPLIT]")
    try:
        import datasets
    except ImportError:
        raise MfggufError("hf: sources need the `datasets` package; pip install datasets") from None
    if name in _HF_FILE_BUILDERS and len(parts) > 1:
        files = ":".join(parts[1:])
        if not glob.glob(os.path.expanduser(files), recursive=True):
            raise MfggufError(f"source {spec!r}: no files match {files!r}")
        args, kw = (name,), {"data_files": os.path.expanduser(files), "split": "train"}
        default = Path(files.split("*")[0]).stem or Path(files).parent.name or name
    else:
        config = parts[1] if len(parts) > 1 and parts[1] else None
        split = parts[2] if len(parts) > 2 and parts[2] else "train"
        args, kw = (name, config), {"split": split}
        default = name.rsplit("/", 1)[-1]
    try:
        ds = datasets.load_dataset(*args, streaming=True, **kw)
        rows = iter(ds)
        first = next(rows, None)
    except Exception as e:  # datasets raises many kinds; all mean "this source cannot be read"
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise MfggufError(f"cannot load {spec!r} with datasets: {msg}") from None
    if first is None:
        return
    for i, row in enumerate(_chain(first, rows)):
        yield _record_text(row, text_field, default, f"{spec} row {i}")
        if (label or "domain" not in row) and full(label or sanitize_label(default)):
            return  # its only domain is full: stop streaming


def _chain(first, rest):
    yield first
    yield from rest


# ---- text helpers -----------------------------------------------------------------------------------


def sanitize_label(label: str) -> str:
    """A domain label usable as a file name: [A-Za-z0-9_.-], not starting with a dot."""
    s = re.sub(r"[^A-Za-z0-9_.-]+", "_", str(label)).strip("_").lstrip(".")
    return s or "unlabelled"


def split_text(text: str, max_chars: int = MAX_DOC_CHARS) -> list[str]:
    """Cut text at line boundaries into pieces of at most max_chars (a longer line is cut hard)."""
    if len(text) <= max_chars:
        return [text] if text.strip() else []
    pieces, cur, size = [], [], 0
    for line in text.splitlines(keepends=True):
        while len(line) > max_chars:  # one giant line (minified code, tables)
            if cur:
                pieces.append("".join(cur))
                cur, size = [], 0
            pieces.append(line[:max_chars])
            line = line[max_chars:]
        if size + len(line) > max_chars and cur:
            pieces.append("".join(cur))
            cur, size = [], 0
        cur.append(line)
        size += len(line)
    if cur:
        pieces.append("".join(cur))
    return [p for p in pieces if p.strip()]


class _Cap:
    """Per-domain character budget. A document that crosses it is cut at a line boundary."""

    def __init__(self, limit: int | None):
        self.limit = limit
        self.used: dict[str, int] = {}

    def full(self, domain: str) -> bool:
        return self.limit is not None and self.used.get(domain, 0) >= self.limit

    def all_full(self, domains) -> bool:
        return bool(domains) and all(self.full(d) for d in domains)

    def take(self, domain: str, text: str, whole: bool = False) -> str:
        """What of TEXT the budget takes (`whole`: all of it while any budget is left, or nothing)."""
        if self.limit is None:
            return text
        left = self.limit - self.used.get(domain, 0)
        if left <= 0:
            return ""
        if len(text) > left and not whole:
            cut = text.rfind("\n", 0, left)
            text = text[: cut + 1] if cut > 0 else text[:left]
        self.used[domain] = self.used.get(domain, 0) + len(text)
        return text if text.strip() else ""


@contextmanager
def _progress(enabled: bool):
    if not enabled:
        yield None
        return
    from rich.console import Console
    from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn, TransferSpeedColumn

    cols = (SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed:,} chars"),
            TransferSpeedColumn(), TimeElapsedColumn())
    with Progress(*cols, console=Console(stderr=True)) as bar:
        yield bar
