"""README's "Start from a real model" path through the CLI, on the real SmolLM2 base.

Every `mfgguf` line of the section runs as written, but for the sizes of its training and scoring:
1,024 training tokens (one step of 4 sequences) instead of 32,768, and 256 held-out tokens a domain
for the before/after losses and the curve (and so for the router statistics' sample) instead of
4,096, so the path fits in a test on a CPU without bf16 too (the README's own sizes are timed in
docs/base-model.md); the perplexity lines print JSON, which the checks read, and score one window
of 256 tokens of each domain (`--chunks 1 --ctx 256`). The
corpus keeps the README's size: with less, a domain's held-out split can fall under one perplexity
window (which files `study` samples depends on where the venv lives).
Skipped with a one-line reason where the base is not fetched.
"""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest
from typer.testing import CliRunner

from mfgguf.base.known import cached
from mfgguf.cli.app import app

ROOT = Path(__file__).resolve().parents[1]
SMALLER = {"--tokens": "1024", "--eval-tokens": "256"}  # one step of 4 x 256; a small scoring sample
EXTRA = {"train-expert": ["--batch-size", "4", "--curve-tokens", "256"],  # the curve scores the same sample
         "perplexity": ["--json", "--chunks", "1", "--ctx", "256"]}  # one short window a domain

pytestmark = pytest.mark.skipif(cached("smollm2") is None, reason="SmolLM2-135M-Instruct is not fetched: run `make smollm2`")


def _steps() -> list[list[str]]:
    section = (ROOT / "README.md").read_text().split("## Start from a real model", 1)[1].split("\n## ", 1)[0]
    block = re.search(r"```bash\n(.*?)```", section, re.S).group(1)
    steps = []
    for line in block.splitlines():
        if line.startswith("mfgguf "):
            args = shlex.split(line, comments=True)[1:]
            args = [SMALLER.get(args[i - 1], a) if i else a for i, a in enumerate(args)]
            steps.append(args + EXTRA.get(args[0], []))
    return steps


def test_readme_real_base_path_runs(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    runner = CliRunner()
    steps, ppl = _steps(), {}
    assert [s[0] for s in steps][:2] == ["import-base", "prepare"] and "chat" in [s[0] for s in steps]
    for args in steps:
        r = runner.invoke(app, args, input="/quit\n" if args[0] == "chat" else None)
        assert r.exit_code == 0, f"mfgguf {shlex.join(args)}:\n{r.output}"
        if args[0] == "perplexity":
            ppl[args[1]] = json.loads(r.output[r.output.index("{"):])["domains"]
        if args[0] == "train-expert":  # the base's own held-out loss is the "before"
            assert re.search(r"own domain \w+ [\d.]+->[\d.]+", r.output), r.output
    domains = json.loads(Path("smol/run/run.json").read_text())["domains"]
    trained = [domains[int(s[s.index("--expert") + 1]) - 1] for s in steps if s[0] == "train-expert"]
    assert trained == ["cpp", "man"]  # what the README's comments say the two experts are
    base, moe = ppl["smol/base.gguf"], ppl["smol/moe.gguf"]
    assert all(moe[d]["ppl"] != base[d]["ppl"] for d in trained)  # one step moves them; 32,768 tokens lower them
