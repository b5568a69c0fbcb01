"""docs/own-base.md's walk-through (`import-base` and `extend` without a download, linked from the
README), run word for word through the CLI.

The demo's trunk it starts from is the session's tiny trunk assembled as `mfgguf demo` assembles
it (`assemble --experts none --quant q8_0`); every other line is the page's own, in a directory
that holds the repository's README.md, mfgguf/ and tests/ (the walk-through's corpora).
"""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

from typer.testing import CliRunner

from mfgguf.cli.app import app
from mfgguf.converters.assemble import assemble

ROOT = Path(__file__).resolve().parents[1]


def _walkthrough() -> list[list[str]]:
    page = (ROOT / "docs" / "own-base.md").read_text()
    section = page.split("## The walk-through", 1)[1].split("\n## ", 1)[0]
    block = re.search(r"```bash\n(.*?)```", section, re.S).group(1)
    return [shlex.split(line, comments=True)[1:] for line in block.splitlines() if line.startswith("mfgguf ")]


def _ppl(runner: CliRunner, model: str, run: str) -> float:
    r = runner.invoke(app, ["perplexity", model, "--run", run, "--json"])
    assert r.exit_code == 0, r.output
    return json.loads(r.output[r.output.index("{"):])["overall"]["ppl"]


def test_readme_walkthrough_runs_word_for_word(trained_run, tmp_path, monkeypatch):
    for name in ("README.md", "mfgguf", "tests"):
        (tmp_path / name).symlink_to(ROOT / name)
    (tmp_path / "demo-run").mkdir()
    assemble(trained_run, tmp_path / "demo-run" / "trunk-q8_0.gguf", quant="q8_0", experts=[], progress=False)
    monkeypatch.chdir(tmp_path)
    runner = CliRunner()
    steps = _walkthrough()
    verbs = [s[0] for s in steps]
    assert {"import-base", "prepare", "train-expert", "assemble", "chat", "extend"} <= set(verbs)
    for args in steps:
        r = runner.invoke(app, args, input="/quit\n" if args[0] == "chat" else None)
        assert r.exit_code == 0, f"mfgguf {shlex.join(args)}:\n{r.output}"
    # what the comments promise
    assert _ppl(runner, "walk/moe.gguf", "walk/run") < _ppl(runner, "walk/trunk.gguf", "walk/run")
    assert _ppl(runner, "walk/moe3.gguf", "walk/more") < _ppl(runner, "walk/moe.gguf", "walk/more")
    assert Path("walk/moe2.gguf").read_bytes() == Path("walk/moe.gguf").read_bytes()
