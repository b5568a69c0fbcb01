#!/usr/bin/env python3
"""The house's counts, as JSON lines: what the house rules (CONTRIBUTING.md, "House rules") ask to keep at zero.

Usage (from the project root):  python3 scripts/house.py [PACKAGE_DIR=mfgguf]
One line per check, `{"check": NAME, "count": N, "items": [...]}`, in this order:
  long_functions   functions (and methods) over 80 lines, `module::name (lines)`;
  long_modules     modules over 450 lines;
  crowded_folders  folders holding more than 12 modules (`__init__.py`/`__main__.py` not counted);
  cycles           strongly connected sets of two or more modules (imports inside functions count too:
                   a lazy import hides a cycle, it does not remove it);
  private_names    `from b import _name` where b is another module of the package (not from an `__init__`);
  upward_imports   a module importing one on a higher floor of FLOORS (lazy imports count);
  figures          measured figures in docstrings and comments (they live in docs/);
  dead_paths       repository paths named in docstrings and `#` comments, of PACKAGE_DIR and of scripts/, that do
                   not exist: a `<dir>/<name>.py` that no file of the repository ends with (nor one beside the module
                   that names it), a `docs/<page>.md` or `docs/<dir>/<script>.sh` that is not there, a bare
                   `<name>.py` where no file of that name exists anywhere in the repository. Files of other
                   projects (llama.cpp's, transformers') go in EXTERNAL.
Then the docs' counts, over README.md, CONTRIBUTING.md and every Markdown file under docs/ (fenced code is not
prose):
  broken_links     relative links whose file, or whose `#anchor` (GitHub's heading slugs), does not exist;
  headline_figures figures of the "Headline results" table (docs/studies.md) missing from the page the row links;
  diary            lines that read as a log of work rather than a document ("sitting", "this stop", "today"...);
  machine_paths    absolute paths of a machine (/work/, /root/, /home/, /tmp/, /Users/), in code blocks too:
                   examples use relative paths or `~`;
  long_readme      README.md over 250 lines;
  long_guides      guides (docs/*.md, not docs/studies/ or docs/results/, nor the generated docs/cli.md) over 300 lines;
  study_verdicts   reports under docs/studies/ whose first line after the title does not start with
                   "**Verdict" (a study opens with its answer; question, protocol, tables follow).
Standard library only, so it runs before any install. Exit status 0 always: tests/test_house.py judges.

A "figure" is a number with a unit of measure or a ratio: `1.3x`, `45%`, `702 tokens/s`, `1.7 GB`,
`170 ms`, `12 s`, `15 min`, `3 GB/s`, in a docstring (module, class, function) or a `#` comment. Code, strings
that are not docstrings, and bare numbers (a default, a shape, a count) are not figures. A definition
that reads like one (a unit in an example of an option's syntax) goes in ALLOWED, by module and text.
"""
from __future__ import annotations

import ast
import io
import json
import os
import re
import sys
import tokenize
from pathlib import Path

MAX_FUNCTION = 80
MAX_MODULE = 450
MAX_FOLDER = 12

# Floors, bottom to top: a module may import its own floor and those below, never one above.
# An entry names a module or a package (every module under it); the longest matching entry wins.
FLOORS: list[list[str]] = [
    ["errors", "machine", "stages", "budget"],           # ground: no mfgguf import but errors
    ["families"],                                         # model families as data
    ["gguf"],                                             # the GGUF format
    ["__init__", "config", "options", "run", "model", "head_loss", "flops", "plots"],  # configs, the run directory, the model
    ["base", "data", "modules"],                          # importing a base model; corpora and shards; a RUN's module files
    ["runtime"],                                          # llama.cpp
    ["reference"],                                        # the reference model built from the GGUF
    ["train"],                                            # training
    ["converters"],                                       # GGUF assembly (runs the router-stats pass where it must)
    ["eval"],                                             # the comparison report
    ["demo"],                                             # the one-command demo
    ["cli", "__main__"],                                  # the typer app
]

# (module, text) of definitions that the figure heuristic would take for measurements.
ALLOWED: set[tuple[str, str]] = {
    ("mfgguf.train.whole.trunk", "2GiB"),  # an example of the --memory-budget option's syntax
    ("mfgguf.demo", "15 min"),  # the demo's goal, what its token share is chosen for
    ("mfgguf.demo", "4x"),  # the router statistics' sample as a multiple of the held-out one
    ("mfgguf.machine", "8 GiB"),  # the scheduler's fallback where the memory cannot be read
    ("mfgguf.train.fanout.schedule", "8 GiB"),  # the same fallback, where it is used
    ("mfgguf.train.whole.router_tune", "1%"),  # the default tuning budget
    ("mfgguf.eval.baselines.imported", "6x"),  # the FLOP formula of a full training step, by definition
    ("mfgguf.eval.report", "2%"),  # a goal's threshold, stated beside the number it is
    ("mfgguf.train.engine.driver", "20%"),  # the cited paper's cooldown share, which the default is
    ("mfgguf.train.engine.loop", "1 MB"),  # glibc's mmap threshold this sets, by definition
    ("mfgguf.train.engine.loop", "16 MB"),  # a chunk's size, computed from the constant beside it
    ("mfgguf.train.engine.loop", "32 MB"),  # the same, for the scoring chunks
    ("mfgguf.train.experts.pooled", "50 MB"),  # a dim x dim f32 matrix at the `1b` shape, computed
    ("mfgguf.train.experts.shared", "0.5 GB"),  # 16 bytes x 31M parameters, computed
}

# Files that docstrings and comments name and that are another project's.
EXTERNAL: set[str] = {
    "convert_hf_to_gguf.py",  # llama.cpp's converter from Hugging Face checkpoints
    "modeling_granitemoeshared.py", "modeling_mixtral.py", "modeling_qwen2_moe.py", "modeling_qwen3_moe.py",  # transformers'
}
# A repository path: any `.py` (with or without folders), a page or script under docs/, the README.
PATH = re.compile(r"(?<![\w./~-])((?:[\w.-]+/)*[\w-]+\.py|docs/(?:[\w.-]+/)*[\w-]+\.(?:md|sh)|README\.md)(?![\w/])")

UNIT = r"(?:x(?![\w])|×|\s?%|\s?(?:[KMGT]i?B(?:/s)?|tokens/s|tok/s|ms|s|min)(?![\w/]))"
FIGURE = re.compile(r"(?<![\w.])\d[\d,]*(?:\.\d+)?" + UNIT)


def module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def resolve(current: str, is_pkg: bool, level: int, target: str | None) -> str:
    if level == 0:
        return target or ""
    base = current.split(".")
    if not is_pkg:
        base = base[:-1]
    if level > 1:
        base = base[: len(base) - (level - 1)]
    return ".".join(base + ([target] if target else []))


def imports(mods: dict[str, Path], trees: dict[str, ast.Module]):
    """Edges module -> modules it imports (anywhere in it), and private names taken across modules."""
    edges: dict[str, set[str]] = {m: set() for m in mods}
    private: list[str] = []
    for m, tree in trees.items():
        is_pkg = mods[m].name == "__init__.py"
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                edges[m].update(a.name for a in node.names if a.name in mods and a.name != m)
            elif isinstance(node, ast.ImportFrom):
                src = resolve(m, is_pkg, node.level, node.module)
                for a in node.names:
                    sub = f"{src}.{a.name}" if src else a.name
                    if sub in mods:  # `from pkg import module`
                        if sub != m:
                            edges[m].add(sub)
                    elif src in mods and src != m:
                        edges[m].add(src)
                        if a.name.startswith("_") and not a.name.startswith("__") and not is_pkg:
                            private.append(f"{m} <- {src}.{a.name}")
    return edges, private


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components of two or more modules."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def strong(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in edges[v]:
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    sys.setrecursionlimit(10_000)
    for v in sorted(edges):
        if v not in index:
            strong(v)
    return out


def floor(package: str, module: str) -> int | None:
    rel = module[len(package) + 1:] if module != package else "__init__"
    best, level = -1, None
    for i, names in enumerate(FLOORS):
        for name in names:
            if (rel == name or rel.startswith(name + ".")) and len(name) > best:
                best, level = len(name), i
    return level


def upward(package: str, edges: dict[str, set[str]]) -> list[str]:
    out = []
    for a in sorted(edges):
        for b in sorted(edges[a]):
            fa, fb = floor(package, a), floor(package, b)
            if fa is None or fb is None:
                out.append(f"{a} -> {b} (no floor for {a if fa is None else b})")
            elif fb > fa:
                out.append(f"{a} -> {b}")
    return out


def long_functions(m: str, tree: ast.Module) -> list[str]:
    return [f"{m}::{n.name} ({n.end_lineno - n.lineno + 1})" for n in ast.walk(tree)
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.end_lineno - n.lineno + 1 > MAX_FUNCTION]


def prose(source: str, tree: ast.Module) -> list[tuple[int, str]]:
    """(first line, text) of every docstring (module, class, function) and `#` comment of a module."""
    texts: list[tuple[int, str]] = []
    for n in ast.walk(tree):
        if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(n, clean=False)
            if doc is not None and n.body:
                texts.append((n.body[0].lineno, doc))
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            texts.append((tok.start[0], tok.string))
    return texts


def figures(m: str, source: str, tree: ast.Module) -> list[str]:
    out = []
    for line, text in prose(source, tree):
        for hit in FIGURE.finditer(text):
            if (m, hit.group().strip()) not in ALLOWED:
                out.append(f"{m}:{line + text[:hit.start()].count(chr(10))}: {hit.group().strip()}")
    return out


def repo_files(repo: Path) -> list[str]:
    """Every file of the repository, as a path relative to it (hidden folders and caches left out)."""
    out = []
    for p in repo.rglob("*"):
        rel = p.relative_to(repo)
        if p.is_file() and not any(s.startswith(".") or s == "__pycache__" for s in rel.parts[:-1]):
            out.append(rel.as_posix())
    return out


def dead_paths(repo: Path, dirs: list[Path]) -> list[str]:
    """Paths named in the docstrings and comments of the modules under `dirs` that no file of `repo` has."""
    files = repo_files(repo)
    names = {f.rsplit("/", 1)[-1] for f in files}
    out = []
    for d in dirs:
        for path in sorted(d.rglob("*.py")):
            source = path.read_text(encoding="utf-8")
            for line, text in prose(source, ast.parse(source, str(path))):
                for hit in PATH.finditer(text):
                    named = hit.group(1)
                    if named in EXTERNAL:
                        continue
                    if "/" in named:
                        here = (path.parent / named).resolve()
                        found = here.is_file() or any(f == named or f.endswith("/" + named) for f in files)
                    else:
                        found = named in names
                    if not found:
                        where = line + text[:hit.start()].count("\n")
                        out.append(f"{path.relative_to(repo).as_posix()}:{where}: {named}")
    return out


MAX_README = 250
MAX_GUIDE = 300
GENERATED = {"cli.md"}  # docs/cli.md: the verb reference, written by scripts/gen_cli_docs.py from the CLI's help
FENCE = re.compile(r"^```.*?^```[^\n]*$", re.S | re.M)
LINK = re.compile(r"\]\(([^)\s]+)\)")
DIARY = re.compile(r"\b(?:sittings?|this stop|this session|today|yesterday|tonight|this morning|"
                   r"earlier day|another day|this time)\b", re.I)
MACHINE_PATH = re.compile(r"(?<![\w.~])/(?:work|root|home|tmp|Users)/")
# A figure of the headline table: a number with decimals, or a number with a unit of measure or a ratio.
HEADLINE_FIGURE = re.compile(r"(?<![\w.])\d[\d,]*(?:\.\d+)?(?=\s?(?:x\b|%|[KMGT]i?B\b|tokens/s|s\b|min\b))"
                             r"|(?<![\w.])\d[\d,]*\.\d+")


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: link text kept, lowercase, punctuation but - and _ dropped, spaces to -."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip())
    text = re.sub(r"[^\w\- ]", "", text.lower())
    return text.replace(" ", "-")


def anchors(text: str) -> set[str]:
    out: set[str] = set()
    for line in FENCE.sub("", text).splitlines():
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if m:
            base = slug(m.group(1))
            name, n = base, 0
            while name in out:  # GitHub numbers repeated headings: name, name-1, name-2
                n += 1
                name = f"{base}-{n}"
            out.add(name)
    return out


def markdown_files(repo: Path) -> list[Path]:
    top = [repo / name for name in ("README.md", "CONTRIBUTING.md") if (repo / name).exists()]
    return top + sorted((repo / "docs").rglob("*.md"))


def broken_links(repo: Path, files: list[Path]) -> list[str]:
    out = []
    for path in files:
        for target in LINK.findall(FENCE.sub("", path.read_text(encoding="utf-8"))):
            if "://" in target or target.startswith("mailto:"):
                continue
            name, _, anchor = target.partition("#")
            dest = (path.parent / name).resolve() if name else path
            where = f"{path.relative_to(repo)}: {target}"
            if not dest.exists():
                out.append(where)
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest.read_text(encoding="utf-8")):
                out.append(where + " (no such heading)")
    return out


HEADLINES = ("docs/studies.md", ("Headline results",))  # the page of the headline table, and its sections


def headline_figures(repo: Path, page: str = HEADLINES[0], sections: tuple[str, ...] = HEADLINES[1]) -> list[str]:
    """Each figure in the figure cell (the second) of a headline table must appear in the page its row links."""
    path = repo / page
    if not path.exists():
        return []
    text = path.read_text(encoding="utf-8")
    out = []
    for name in sections:
        m = re.search(rf"^## {re.escape(name)}\n(.*?)(?=^## |\Z)", text, re.S | re.M)
        for row in re.findall(r"^\|(.+)\|\s*$", m.group(1) if m else "", re.M):
            cells = [c.strip() for c in row.split("|")]
            links = LINK.findall(row)
            if len(cells) < 3 or not links or set(cells[1]) <= set("-: "):
                continue
            target = Path(os.path.normpath(path.parent / links[-1].partition("#")[0]))
            if not target.is_file():
                continue  # broken_links reports it
            linked = target.read_text(encoding="utf-8").replace("**", "")
            for fig in HEADLINE_FIGURE.findall(cells[1].replace("**", "")):
                if not re.search(rf"(?<![\w.]){re.escape(fig)}(?![\d])", linked):
                    out.append(f"{page}: {fig} ({cells[0][:50]}) not in {target.relative_to(repo)}")
    return out


def docs(repo: Path) -> dict[str, list[str]]:
    """The docs' counts for the repository at `repo` (README.md and docs/)."""
    files = markdown_files(repo)
    diary, paths, guides, verdicts, long_readme = [], [], [], [], []
    for path in files:
        rel = path.relative_to(repo)
        text = path.read_text(encoding="utf-8")
        prose = FENCE.sub(lambda f: "\n" * f.group(0).count("\n"), text)
        for n, line in enumerate(prose.splitlines(), 1):
            if hit := DIARY.search(line):
                diary.append(f"{rel}:{n}: {hit.group()}")
        for n, line in enumerate(text.splitlines(), 1):
            if hit := MACHINE_PATH.search(line):
                paths.append(f"{rel}:{n}: {hit.group()}")
        lines = len(text.splitlines())
        if rel.as_posix() == "README.md" and lines > MAX_README:
            long_readme.append(f"README.md ({lines})")
        if rel.parent.as_posix() == "docs" and rel.name not in GENERATED and lines > MAX_GUIDE:
            guides.append(f"{rel} ({lines})")
        if rel.parent.as_posix() == "docs/studies":
            body = [ln for ln in text.splitlines() if ln.strip()]
            if not (len(body) > 1 and body[0].startswith("# ") and body[1].startswith("**Verdict")):
                verdicts.append(str(rel))
    return {"broken_links": broken_links(repo, files), "headline_figures": headline_figures(repo), "diary": diary,
            "machine_paths": paths, "long_readme": long_readme, "long_guides": guides, "study_verdicts": verdicts}


def house(root: Path) -> list[dict]:
    package = root.name
    mods = {module_name(root, p): p for p in sorted(root.rglob("*.py"))}
    sources = {m: p.read_text(encoding="utf-8") for m, p in mods.items()}
    trees = {m: ast.parse(s, str(mods[m])) for m, s in sources.items()}
    edges, private = imports(mods, trees)
    folders: dict[Path, int] = {}
    for p in mods.values():
        folders.setdefault(p.parent, 0)
        if p.name not in ("__init__.py", "__main__.py"):
            folders[p.parent] += 1
    checks = {
        "long_functions": [f for m in mods for f in long_functions(m, trees[m])],
        "long_modules": [f"{m} ({n})" for m in mods if (n := len(sources[m].splitlines())) > MAX_MODULE],
        "crowded_folders": [f"{d.relative_to(root.parent)} ({n})" for d, n in sorted(folders.items()) if n > MAX_FOLDER],
        "cycles": [" <-> ".join(c) for c in cycles(edges)],
        "private_names": private,
        "upward_imports": upward(package, edges),
        "figures": [f for m in mods for f in figures(m, sources[m], trees[m])],
        "dead_paths": dead_paths(root.parent, [root] + [d for d in [root.parent / "scripts"] if d.is_dir()]),
        **docs(root.parent),
    }
    return [{"check": k, "count": len(v), "items": v} for k, v in checks.items()]


def main(argv: list[str]) -> int:
    root = Path(argv[1] if len(argv) > 1 else "mfgguf").resolve()
    for line in house(root):
        print(json.dumps(line))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
