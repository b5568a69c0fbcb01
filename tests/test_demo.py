"""`mfgguf demo` end to end on the tiny preset: every stage in its own process, then resume."""

from __future__ import annotations

import json

from gguf import GGUFReader
from typer.testing import CliRunner

from mfgguf.budget import MAX_FACTOR
from mfgguf.cli.app import app


def e_tokens(out) -> int:
    """The tokens expert 1 was asked to train (its record's)."""
    return int(json.loads((out / "run" / "modules" / "expert_001.json").read_text())["train"]["tokens"])


def test_demo_runs_end_to_end_and_resumes(tmp_path):
    out = tmp_path / "demo"
    # two sync rounds, not the default's four: each stage is a process of its own, whose start costs more than its steps
    args = ["demo", "--out", str(out), "--preset", "tiny", "--experts", "3", "--max-chars-per-domain", "150000",
            "--rounds", "2"]
    r = CliRunner().invoke(app, args)
    assert r.exit_code == 0, r.output
    s = json.loads((out / "summary.json").read_text())
    names = [st["stage"] for st in s["stages"]]
    cfg = s["config"]  # the defaults: experts that train the whole trunk too, in sync rounds
    assert cfg["shared"] != "none" and cfg["rounds"] == 2 and cfg["seed_expert"]
    experts = [f"train-expert {i} round {r}" for r in range(1, cfg["rounds"] + 1) for i in (1, 2, 3)]
    syncs = [f"sync {r}" for r in range(1, cfg["rounds"] + 1)]
    # the time budget (13 min by default) is fitted from the speed measured first, the experts again once the trunk
    # has trained; tiny fits the most the budget may train (MAX_FACTOR x the default) with time to spare
    assert names[:3] == ["prepare", "measure speed", "train-trunk"]
    b = s["budget"]
    assert b["factor"] == MAX_FACTOR and b["trunk_tokens_per_s"] > 0 and b["predicted_s"] <= 60 * cfg["minutes"]
    assert b["refit"]["expert_factor"] == MAX_FACTOR and b["refit"]["trunk_tokens_per_s"] > 0
    assert e_tokens(out) == b["expert_tokens"]
    assert json.loads((out / "budget.json").read_text()) == b
    assert [n for n in names if n.startswith(("train-expert", "sync"))] == \
        [x for r in range(cfg["rounds"]) for x in experts[3 * r: 3 * r + 3] + [syncs[r]]]
    trunk = json.loads((out / "run" / "modules" / "trunk.json").read_text())
    assert trunk["final"] and trunk["syncs"] == cfg["rounds"] and trunk["config"]["seed_expert"]
    assert cfg["schedule"] == trunk["train"]["schedule"] == "wsd" and trunk["branch"]["step"] > 0  # experts branch
    e1 = json.loads((out / "run" / "modules" / "expert_001.json").read_text())  # from the stable phase
    assert e1["train"]["schedule"] == "wsd" and e1["branch_start"]["step"] == trunk["branch"]["step"]
    assert all(st["peak_rss_mb"] > 50 for st in s["stages"] if st["stage"].startswith("train"))
    # each training stage says how much of its wall its steps took (the rest is its fixed cost)
    assert all(0 < st["train_s"] < st["wall_s"] for st in s["stages"] if st["stage"].startswith("train"))
    assert all(st["train_s"] is None for st in s["stages"] if not st["stage"].startswith("train"))
    assert "s of training steps in" in (out / "summary.md").read_text()
    assert "so it ends early" in (out / "summary.md").read_text()  # the budget unfilled, and why
    ppl = s["perplexity"]
    assert set(ppl) == {"trunk alone", "assembled MoE"}
    # Experts train on top of the trunk and start as a no-op: the assembled model must not be worse.
    assert ppl["assembled MoE"]["overall"]["ppl"] < ppl["trunk alone"]["overall"]["ppl"]
    assert s["files"]["model-q8_0.gguf"] > s["files"]["trunk-q8_0.gguf"]
    moe = GGUFReader(out / "model-q8_0.gguf")  # the measured best, not assemble's exact-function default of 1
    assert int(moe.fields["granitemoe.expert_used_count"].contents()) == cfg["top_k"] == 2
    assert "mfgguf chat" in r.output and "mfgguf eval" in r.output
    assert (out / "summary.md").read_text().count("|") > 20

    # Re-run: every training stage is skipped, results are recomputed from the same files.
    r2 = CliRunner().invoke(app, args)
    assert r2.exit_code == 0, r2.output
    s2 = json.loads((out / "summary.json").read_text())
    skipped = {st["stage"] for st in s2["stages"] if st["skipped"]}
    assert {"prepare", "train-trunk", "train-expert 1 round 1", f"sync {cfg['rounds']}", "assemble"} <= skipped
    assert s2["perplexity"]["assembled MoE"]["overall"]["ppl"] == ppl["assembled MoE"]["overall"]["ppl"]
    assert s2["budget"] == b and "measure speed" not in {st["stage"] for st in s2["stages"]}  # the plan is kept


def test_demo_refuses_a_foreign_directory(tmp_path):
    (tmp_path / "notes.txt").write_text("my work")
    r = CliRunner().invoke(app, ["demo", "--out", str(tmp_path), "--preset", "tiny"])
    assert r.exit_code == 1
    assert r.output.strip().startswith("error:") and "Traceback" not in r.output
    assert (tmp_path / "notes.txt").read_text() == "my work"
