"""docs/cli.md is the CLI's own help: regenerated here from the typer app (scripts/gen_cli_docs.py), it must
read the same as the file in the repository, so a verb or option that changes changes the page."""

from __future__ import annotations

import re
from pathlib import Path

from tests.conftest import script_module

ROOT = Path(__file__).resolve().parents[1]


def _gen():
    return script_module("gen_cli_docs")


def test_cli_docs_are_current():
    gen = _gen()
    want = gen.render()
    have = (ROOT / "docs" / "cli.md").read_text(encoding="utf-8")
    if have != want:
        diff = next((f"line {i}: docs/cli.md has {a!r}, the CLI gives {b!r}"
                     for i, (a, b) in enumerate(zip(have.splitlines(), want.splitlines()), 1) if a != b),
                    f"docs/cli.md has {len(have.splitlines())} lines, the CLI gives {len(want.splitlines())}")
        raise AssertionError(f"docs/cli.md is out of date with the CLI's help ({diff}): run "
                             "`.venv/bin/python scripts/gen_cli_docs.py` and commit docs/cli.md")


def test_cli_docs_list_every_verb_and_no_hidden_option():
    import typer.main

    from mfgguf.cli.app import app

    group = typer.main.get_command(app)
    text = _gen().render()
    sections = dict(re.findall(r"^## (\S+)\n(.*?)(?=^## |\Z)", text, re.S | re.M))
    assert list(sections) == list(group.commands), "docs/cli.md's verbs and the CLI's differ"
    for name, cmd in group.commands.items():
        rows = re.findall(r"^\| `(?:-\w, )?(--[\w-]+)", sections[name], re.M)
        shown = [max(p.opts, key=len) for p in cmd.params
                 if p.param_type_name == "option" and not getattr(p, "hidden", False)]
        assert rows == shown, name
