"""The README and docs show only commands that exist: every `mfgguf VERB --option` they print is
checked against the real typer app (its click object), and CONTRIBUTING.md's layout against the
package tree. A page whose code blocks call a bare `mfgguf` says near its top that the venv must be
active. (docs/cli.md, the verb reference, is checked against the CLI by tests/test_cli_docs.py.)

Commands are read from fenced code blocks (line continuations joined, `#` comments dropped) and
from inline code spans; a span that starts with a verb name and shows an option (`assemble --top-k
2`) counts as a command too. Placeholders (RUN, FILE, `...`) are positional and not checked;
`[--opt X]` brackets, `--flag/--no-flag` pairs and `--opt=value` are understood.
"""

from __future__ import annotations

import re
import shlex
from functools import lru_cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").rglob("*.md"))]
FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.S | re.M)
SPAN = re.compile(r"(?<!`)`([^`]+)`(?!`)")
OPTION = re.compile(r"^--?[A-Za-z]")
STOP = {"&&", "||", ";", "|", ">", ">>", "2>&1", "&"}


@lru_cache(maxsize=1)
def cli():
    """The click group of the real app: {verb: {option strings}} and the group's own options. A hidden option
    (one a verb takes only to refuse it in one line, cli/options.py) is none of the verb's."""
    import typer.main

    from mfgguf.cli.app import app

    group = typer.main.get_command(app)
    verbs = {}
    for name, cmd in group.commands.items():
        opts = {"--help"}
        for p in cmd.params:
            if getattr(p, "hidden", False):
                continue
            opts.update(p.opts)
            opts.update(p.secondary_opts)
        verbs[name] = opts
    top = {"--help"} | {o for p in group.params for o in (*p.opts, *p.secondary_opts)}
    return verbs, top


def _tokens(text: str) -> list[str]:
    try:
        return shlex.split(text, comments=True)
    except ValueError:  # an unbalanced quote in prose: fall back to words
        return text.split("#")[0].split()


def _command(tokens: list[str], verbs: set[str], bare: bool) -> tuple[str, list[str]] | None:
    """(verb, options) of the first mfgguf command in `tokens`; `bare`: it may start with the verb."""
    start = next((i + 1 for i, t in enumerate(tokens) if t == "mfgguf" or t.endswith("/mfgguf")), None)
    if start is None:
        if not (bare and tokens and tokens[0] in verbs and any(t.lstrip("[").startswith("--") for t in tokens)):
            return None
        start = 0
    if start >= len(tokens) or tokens[start] in ("...", *STOP):  # `cd mfgguf && ...`: the folder
        return None
    verb, opts, depth = tokens[start], [], 0
    for t in tokens[start + 1:]:
        if t in STOP and depth == 0:
            break
        depth += t.count("[") - t.count("]")
        t = t.strip("[]()")
        if OPTION.match(t):
            opts += [o for o in t.split("=")[0].split("/") if OPTION.match(o)]  # --flag/--no-flag, --opt=x/y
    return verb, opts


def commands(path: Path, root: Path = ROOT) -> list[tuple[str, str, list[str]]]:
    """(where, verb, options) for every mfgguf command shown in a Markdown file."""
    verbs = set(cli()[0])
    text = path.read_text()
    found = []
    for block in FENCE.finditer(text):
        line0 = text[:block.start()].count("\n") + 2
        for n, line in enumerate(block.group(1).replace("\\\n", " ").splitlines()):
            cmd = _command(_tokens(line), verbs, bare=False)
            if cmd:
                found.append((f"{path.relative_to(root)}:{line0 + n}", *cmd))
    prose = FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), text)
    for span in SPAN.finditer(prose):
        for part in re.split(r"\s*(?:&&|;)\s*", " ".join(span.group(1).split())):
            cmd = _command(_tokens(part), verbs, bare=True)
            if cmd:
                found.append((f"{path.relative_to(root)}:{prose[:span.start()].count(chr(10)) + 1}", *cmd))
    return found


# What the studies measured not to pay and mfgguf removed: the study pages still say how they were run
# (docs/studies.md names the commit that runs them). {verb: its removed options}; None: the whole verb.
REMOVED = {"relabel": None, "train-expert": {"--complement", "--expert-layers", "--ffn-rounds"},
           "train-experts": {"--complement", "--expert-layers", "--ffn-rounds", "--outer-lr", "--outer-momentum"},
           "sync": {"--outer-lr", "--outer-momentum", "--merge-density"}, "assemble": {"--merge-density"},
           "calibrate": {"--bias", "--bias-passes"}, "router-stats": {"--source"}}


def problems(verb: str, opts: list[str]) -> list[str]:
    """What is wrong with `mfgguf verb opts...` against the real CLI (empty: nothing)."""
    verbs, top = cli()
    if verb.startswith("-"):
        return [f"mfgguf has no option {o}" for o in [verb, *opts] if o not in top]
    if verb in REMOVED and REMOVED[verb] is None:
        return []
    if verb not in verbs:
        return [f"mfgguf has no verb {verb!r}"]
    return [f"`mfgguf {verb}` has no option {o}" for o in opts if o not in verbs[verb] | REMOVED.get(verb, set())]


ALL = [c for p in DOCS for c in commands(p)]


@pytest.mark.parametrize("where,verb,opts", ALL, ids=[f"{w} {v}" for w, v, _ in ALL])
def test_documented_command_exists(where, verb, opts):
    assert not problems(verb, opts), f"{where}: {problems(verb, opts)}"


def test_commands_are_found():
    """The parser sees the README's commands (a parser that finds nothing would pass everything)."""
    readme = [(v, o) for w, v, o in ALL if w.startswith("README.md")]
    assert len(readme) >= 15
    assert ("assemble", ["-o", "--quant", "--top-k"]) in readme
    assert {v for v, _ in readme} >= {"prepare", "train-trunk", "train-experts", "assemble", "chat", "generate"}
    assert len(ALL) >= 60  # README + docs/


def test_wrong_verbs_and_options_are_caught(tmp_path):
    bad = tmp_path / "bad.md"
    bad.write_text("```bash\nmfgguf assemble RUN -o m.gguf \\\n   --quantize q8_0   # a comment --not-checked\n"
                   "mfgguf trian-expert RUN --expert 1\n```\n\nSee `sync --outer-rate 0.7` and `mfgguf chat M "
                   "[--temperature T | --no-color]`; `train-trunk --seed-expert/--no-seed-expert` is fine.\n")
    found = [(v, o) for _, v, o in commands(bad, root=tmp_path)]
    assert found == [("assemble", ["-o", "--quantize"]), ("trian-expert", ["--expert"]),
                     ("sync", ["--outer-rate"]), ("chat", ["--temperature", "--no-color"]),
                     ("train-trunk", ["--seed-expert", "--no-seed-expert"])]
    assert [bool(problems(v, o)) for v, o in found] == [True, True, True, True, False]


def _section(name: str, page: str = "README.md") -> str:
    text = (ROOT / page).read_text()
    m = re.search(rf"^## {re.escape(name)}\n(.*?)(?=^## |\Z)", text, re.S | re.M)
    assert m, f"{page} has no section {name!r}"
    return m.group(1)


def test_layout_matches_the_tree():
    block = FENCE.search(_section("Layout", "CONTRIBUTING.md")).group(1)
    listed, top = set(), None
    for line in block.splitlines():
        m = re.match(r"^( *)(\S+?/?)\s", line + " ")
        if not m or not m.group(2)[0].isalnum():
            continue
        name = m.group(2)
        if not m.group(1):
            top = name if name.endswith("/") else None
            path = ROOT / name
        elif top and len(m.group(1)) == 2:
            path = ROOT / top / name
        else:
            continue
        assert path.exists(), f"CONTRIBUTING.md's layout names {path.relative_to(ROOT)}, which does not exist"
        listed.add(path)
    pkg = ROOT / "mfgguf"
    want = {p for p in pkg.iterdir() if (p.is_dir() and (p / "__init__.py").exists())
            or (p.suffix == ".py" and p.name not in ("__init__.py", "__main__.py"))}
    assert not want - listed, f"CONTRIBUTING.md's layout misses {sorted(p.name for p in want - listed)}"


def test_relative_links_resolve():
    """Every relative link and image in the README, CONTRIBUTING.md and docs names a file that exists."""
    broken = []
    for path in DOCS:
        prose = FENCE.sub("", path.read_text())
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", prose):
            if "://" not in target and not (path.parent / target).exists():
                broken.append(f"{path.relative_to(ROOT)}: {target}")
    assert not broken


ACTIVATE = ". .venv/bin/activate"


def test_pages_with_bare_commands_say_the_venv_is_active():
    """A guide's commands run word for word: where a code block calls a bare `mfgguf` (not .venv/bin/mfgguf),
    the page says to activate the venv before that block. docs/results/ holds records, not guides."""
    missing = []
    for path in DOCS:
        if "results" in path.relative_to(ROOT).parts:
            continue
        text = path.read_text()
        first = next((block.start() for block in FENCE.finditer(text)
                      if any(re.match(r"(?:\$ )?mfgguf\s", line) for line in block.group(1).splitlines())), None)
        if first is not None and ACTIVATE not in text[:first]:
            missing.append(str(path.relative_to(ROOT)))
    assert not missing, f"pages with bare `mfgguf` commands that do not say `{ACTIVATE}` before them: {missing}"
