"""The house's counts (scripts/house.py) stay at zero: no function over 80 lines, no module over 450, no folder
of more than 12 modules, no import cycle, private name taken across modules or import up a floor, no measured
figure in a docstring or comment (figures live in docs/), and no docstring or comment naming a repository path that
does not exist. And the docs': every link and anchor resolves, every
figure of the headline table (docs/studies.md) is in the page its row links, no line reads as a diary or names a
machine's path, the README stays within 250 lines and each guide within 300, and every study report opens with its
verdict."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.conftest import script_module

ROOT = Path(__file__).resolve().parents[1]
ZERO = ("upward_imports", "cycles", "private_names", "long_modules", "crowded_folders", "long_functions", "figures",
        "dead_paths", "broken_links", "headline_figures", "diary", "machine_paths", "long_readme", "long_guides", "study_verdicts")


def _counts() -> dict[str, dict]:
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "house.py"), str(ROOT / "mfgguf")],
                         capture_output=True, text=True, check=True).stdout
    return {d["check"]: d for d in map(json.loads, out.splitlines())}


def test_house_counts():
    counts = _counts()
    assert set(ZERO) <= set(counts)
    for check in ZERO:
        assert counts[check]["count"] == 0, (check, counts[check]["items"])


def _house():
    return script_module("house")


def test_docs_checks_catch_a_bad_tree(tmp_path):
    """Each docs count finds what it is for in a small tree (a check that finds nothing would pass anything)."""
    house = _house()
    (tmp_path / "docs" / "studies").mkdir(parents=True)
    (tmp_path / "docs" / "guide.md").write_text(
        "# Guide\n\n## Set-up: two commands\n\nSee [the study](studies/s.md#verdict-first), [gone](nope.md),\n"
        "[an anchor](#set-up-two-commands), [a missing one](#no-such-heading) and [a folder](studies/).\n"
        "In the third sitting the run was stopped.\n\n```bash\nmfgguf chat /tmp/model.gguf\n```\n"
        + "line\n" * 300)
    (tmp_path / "docs" / "studies" / "s.md").write_text("# Study\n\n## Verdict first\n\nThe table: 3.14 and 2 s.\n")
    (tmp_path / "docs" / "studies" / "good.md").write_text("# Good\n\n**Verdict:** it pays.\n")
    (tmp_path / "docs" / "studies.md").write_text(
        "# Studies\n\n## Headline results\n\n| result | figure | details |\n|---|---|---|\n"
        "| pi | 3.14 and 2 s, 1.5x faster | [study](studies/s.md) |\n\n## Next\n")
    (tmp_path / "README.md").write_text("# x\n\n## Next\n" + "line\n" * 256)
    got = house.docs(tmp_path)
    assert got["broken_links"] == ["docs/guide.md: nope.md", "docs/guide.md: #no-such-heading (no such heading)"]
    assert got["headline_figures"] == ["docs/studies.md: 1.5 (pi) not in docs/studies/s.md"]
    assert got["diary"] == ["docs/guide.md:7: sitting"]
    assert got["machine_paths"] == ["docs/guide.md:10: /tmp/"]
    assert got["long_readme"] == ["README.md (259)"]
    assert got["long_guides"] == ["docs/guide.md (311)"]
    assert got["study_verdicts"] == ["docs/studies/s.md"]


def test_dead_paths_finds_the_files_that_are_gone(tmp_path):
    """Paths that exist (from the root, by their tail, beside the module, a bare name anywhere) pass; gone ones and
    outputs that are not the repository's (a report.md, RUN/x.json) are told apart."""
    house = _house()
    (tmp_path / "pkg" / "sub").mkdir(parents=True)
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "guide.md").write_text("# Guide\n")
    (tmp_path / "pkg" / "sub" / "stats.py").write_text("")
    (tmp_path / "pkg" / "sub" / "mod.py").write_text(
        '"""Reads sub/stats.py, pkg/sub/stats.py, stats.py and docs/guide.md; writes report.md and RUN/run.json.\n\n'
        'Once in routerstats.py, then in sub/gone.py and docs/gone.md; llama.cpp\'s convert_hf_to_gguf.py."""\n'
        "x = 1  # see old/place.py\n")
    got = house.dead_paths(tmp_path, [tmp_path / "pkg"])
    assert got == ["pkg/sub/mod.py:3: routerstats.py", "pkg/sub/mod.py:3: sub/gone.py", "pkg/sub/mod.py:3: docs/gone.md",
                   "pkg/sub/mod.py:4: old/place.py"]


def test_slugs_are_githubs():
    house = _house()
    assert house.slug("Families: what differs between llama, Llama 3.x, Qwen2 and Qwen3") == \
        "families-what-differs-between-llama-llama-3x-qwen2-and-qwen3"
    assert house.slug("Experts that adapt attention too: `--shared attn` and sync rounds") == \
        "experts-that-adapt-attention-too---shared-attn-and-sync-rounds"
    assert house.slug("The [README](x.md) path, timed") == "the-readme-path-timed"
    assert house.anchors("# A\n## A\n```\n# not a heading\n```\n## A\n") == {"a", "a-1", "a-2"}


def test_floors_name_every_module():
    """A module no floor names is reported as an upward import, so a new top-level module needs its floor."""
    house = _house()
    root = ROOT / "mfgguf"
    for p in root.rglob("*.py"):
        assert house.floor("mfgguf", house.module_name(root, p)) is not None, p
