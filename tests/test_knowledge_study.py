"""scripts/studies/knowledge_study.py: its plan and refusal (--dry-run runs nothing), the epochs' choice rule and the
summary from synthetic JSON lines. Nothing trains here."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "studies" / "knowledge_study.py"
sys.path[:0] = [str(ROOT / "scripts" / "studies")]

import knowledge_study as ks  # noqa: E402

EPYC = {"model": "AMD EPYC", "flags": ["avx2", "fma"], "cores": 2, "class": "AVX2-only"}


def p1(epochs: int, acc: float) -> dict:
    return {"phase": 1, "run": f"p1-e{epochs}", "epochs": epochs, "seed": 1,
            "valid_questions": {"accuracy": acc, "correct": round(20 * acc), "tasks": 20, "base_accuracy": 0.4,
                                "points": 100 * (acc - 0.4), "low": 100 * (acc - 0.4) - 10,
                                "high": 100 * (acc - 0.4) + 10, "mcnemar_p": 0.1},
            "valid_ppl": {"man": 5.0 - epochs / 10}, "valid_ppl_base": {"man": 6.0}, "machines": [EPYC],
            "recipe": {"base": "smollm2", "domains": ["man", "python"]}}


def bench(right: int, tasks: int = 40, sha: str = "q1") -> dict:
    """A benchmark's figures as a phase-2 line keeps them: the first `right` of `tasks` tasks right (so two models'
    right tasks nest), the ids as one range."""
    return {"accuracy": right / tasks, "tasks": tasks, "data_sha256": sha, "task_ids": [[0, tasks - 1]],
            "right": "1" * right + "0" * (tasks - right)}


# seed -> method -> questions-train-test tasks right of 40; the base at 16 (40%) in both seeds
RIGHT = {1: {"moe": 28, "flop": 25, "lora": 18, "lora-domain": 26, "base": 16},
         2: {"moe": 30, "flop": 24, "lora": 15, "lora-domain": 30, "base": 16}}


def model(right: int, base: bool = False) -> dict:
    return {"label": "x", "flops": 0.0 if base else 1e14, "ppl_test_trained": 3.0 + base, "ppl_test_untrained": 9.0,
            "questions-train-test": bench(right), "questions-test": bench(20)}


def p2(seed: int, method: str) -> dict:
    """A phase-2 line of one method's run: the moe run holds the MoE and the base."""
    r = RIGHT[seed]
    models = {"moe": model(r["moe"]), "base": model(r["base"], True)} if method == "moe" else {method: model(r[method])}
    return {"phase": 2, "run": f"p2-e4-s{seed}-{method}", "method": method, "epochs": 4, "seed": seed,
            "models": models, "machines": [EPYC], "recipe": {"base": "smollm2", "domains": ["man", "python"]}}


def test_the_choice_rule_takes_the_best_validation_accuracy_ties_to_fewer_epochs():
    rows = [p1(1, 0.45), p1(2, 0.60), p1(4, 0.60), p1(8, 0.55)]
    assert ks.choose_epochs(rows, [1, 2, 4, 8], 16) == (2, False)  # 2 and 4 tie: the fewer
    assert ks.choose_epochs(rows[:3], [1, 2, 4, 8], 16) == (None, False)  # phase 1 not done
    climbing = [p1(1, 0.45), p1(2, 0.50), p1(4, 0.55), p1(8, 0.65)]
    assert ks.choose_epochs(climbing, [1, 2, 4, 8], 16) == (None, True)  # 8 still climbing: 16 first
    assert ks.choose_epochs(climbing, [1, 2, 4, 8], None) == (8, False)  # no extension asked
    assert ks.choose_epochs([*climbing, p1(16, 0.65)], [1, 2, 4, 8], 16) == (8, False)  # 16 ties 8: the fewer
    assert ks.choose_epochs([*climbing, p1(16, 0.70)], [1, 2, 4, 8], 16) == (16, False)
    flat = [p1(1, 0.45), p1(2, 0.50), p1(4, 0.65), p1(8, 0.65)]  # 8 ties 4: not climbing, 4 chosen
    assert ks.choose_epochs(flat, [1, 2, 4, 8], 16) == (4, False)


def test_cpu_class():
    assert ks.cpu_class({"flags": ["avx2", "fma"]}) == "AVX2-only"
    assert ks.cpu_class({"flags": ["avx2", "avx512f", "avx512_bf16"]}) == "AVX-512 BF16"
    assert ks.cpu_class({"flags": ["avx2", "avx512_bf16", "amx_tile", "amx_bf16"]}) == "AMX"


def test_dry_run_prints_the_plan_with_each_runs_cost_and_runs_nothing(tmp_path):
    out = tmp_path / "ks.jsonl"
    args = [sys.executable, str(SCRIPT), "--out", str(out), "--base", str(tmp_path / "no-base.gguf"), "--dry-run",
            "--max-chars-per-domain", "40000", "--sitting-hours", "100"]
    text = subprocess.run(args, capture_output=True, text=True, check=True).stdout
    assert not out.exists() and not (tmp_path / "ks").exists()
    lines = text.splitlines()
    assert lines[0].startswith("# CPU: ") and "training FLOP/s" in lines[0]
    shard = int(lines[1].split("man ")[1].split(" tokens")[0].replace(",", ""))  # estimated from the cap
    p2names = [f"p2-e8-s{s}-{m}" for s in (1, 2) for m in ("moe", "flop", "lora", "lora-domain")]
    for name in ("p1-e1", "p1-e2", "p1-e4", "p1-e8", *p2names):
        assert any(l.startswith(f"# {name}: phase ") and " h" in l for l in lines), name
    experts = [l for l in lines if l.startswith("mfgguf train-expert ")]
    # phase 1's four runs and each seed's moe run (phase 1's run at 8 epochs is not on disk to reuse); no baseline's
    assert len(experts) == 2 * 6 and {l.split("--expert ")[1].split()[0] for l in experts} == {"4", "5"}
    assert f"--tokens {8 * shard}" in next(l for l in experts if "/p1-e8 " in l)
    assert all("--seed 2" in l for l in experts if "/p2-e8-s2-moe " in l)
    assert not any("/p2-" in l and "-moe " not in l for l in experts)
    assert sum(l.startswith("mfgguf import-base ") for l in lines) == 1
    assert sum("base.gguf --hellaswag" in l for l in lines) == 1  # the base scored once
    assert any(l.startswith("mfgguf perplexity ") and "train-valid.txt" in l and "--paired-with" in l for l in lines)
    evals = [l for l in lines if l.startswith("mfgguf eval ")]
    assert len(evals) == 8 and all(m in evals[i] for i, m in enumerate(("-moe ", "-flop ", "-lora ", "-lora-domain ")))
    assert all("--baselines none" in l and "--top-k 1" in l for l in evals if "-moe " in l)
    # each baseline alone, at the MoE's training FLOPs: each shard's tokens x 8 epochs x an expert token's FLOPs
    per_token = float(lines[0].split(", ")[-1].split(" MFLOP")[0]) * 1e6
    for m in ("flop", "lora", "lora-domain"):
        line = next(l for l in evals if f"-s1-{m} " in l)
        assert f"--baselines {m} --budget-flops " in line and "--routers" not in line
        budget = dict(x.split(":") for x in line.split("--budget-flops ")[1].split()[0].split(","))
        assert set(budget) == {"4", "5"} and float(budget["4"]) == pytest.approx(8 * shard * per_token, rel=1e-3)
    assert "--hellaswag" not in evals[0]  # optional: no file, no HellaSwag
    with_h = subprocess.run([*args, "--hellaswag", str(tmp_path / "h.txt")], capture_output=True, text=True,
                            check=True).stdout
    assert "--hellaswag-tasks 400" in next(l for l in with_h.splitlines() if l.startswith("mfgguf eval "))


def test_a_run_longer_than_the_sitting_is_refused_in_one_line(tmp_path):
    r = subprocess.run([sys.executable, str(SCRIPT), "--out", str(tmp_path / "ks.jsonl"), "--base",
                        str(tmp_path / "no-base.gguf"), "--dry-run", "--sitting-hours", "0.05"],
                       capture_output=True, text=True)
    assert r.returncode == 1 and r.stderr.count("\n") == 1
    assert "p1-e1 would take about" in r.stderr and "--sitting-hours 0.05" in r.stderr
    assert "# p1-e1: phase 1" in r.stdout and "mfgguf " not in r.stdout  # the plan, then the refusal
    assert not (tmp_path / "ks").exists()


def test_phase_2_before_phase_1_is_priced_at_the_most_epochs_and_not_refused_yet(tmp_path):
    a = ks.parse(["--out", str(tmp_path / "ks.jsonl"), "--dry-run"])
    runs, notes = ks.plan(a, [], tmp_path / "template", ks.SPEEDS["AVX2-only"])
    p2runs = [r for r in runs if r.phase == 2]
    assert [r.name for r in p2runs] == [f"p2-e8-s{s}-{m}" for s in (1, 2) for m in ("moe", "flop", "lora",
                                                                                  "lora-domain")]
    assert all(r.provisional for r in p2runs)
    rows = [p1(1, 0.45), p1(2, 0.60), p1(4, 0.60), p1(8, 0.55), p2(1, "flop")]
    runs, _ = ks.plan(a, rows, tmp_path / "template", ks.SPEEDS["AVX2-only"])
    assert [r.name for r in runs] == [f"p2-e2-s{s}-{m}" for s in (1, 2) for m in ("moe", "flop", "lora",
                                                                                "lora-domain")]
    assert not any(r.provisional for r in runs)
    rows[-1] = {**p2(1, "flop"), "run": "p2-e2-s1-flop", "epochs": 2}  # a run in the lines is not run again
    runs, _ = ks.plan(a, rows, tmp_path / "template", ks.SPEEDS["AVX2-only"])
    assert "p2-e2-s1-flop" not in [r.name for r in runs] and len(runs) == 7


def test_every_phase_2_run_fits_a_sitting_on_the_avx2_cpu_at_the_recipes_cap_up_to_8_epochs(tmp_path):
    a = ks.parse(["--out", str(tmp_path / "ks.jsonl"), "--max-chars-per-domain", "200000", "--hellaswag",
                  str(tmp_path / "h.txt")])
    sp, per_token = ks.SPEEDS["AVX2-only"], ks.expert_flops_per_token(a, tmp_path / "template")
    sz = ks.sizes(a, tmp_path / "template")
    for e in (1, 2, 4, 8):
        costs = {m: ks.phase2_cost(a, sp, per_token, sz, e, m) for m in ("moe", "flop", "lora", "lora-domain")}
        assert all(c < 3 * 3600 for c in costs.values()), (e, costs)
    # the MoE's own training alone, what each baseline's matches, is well inside a sitting at 8 epochs
    flops, train = ks.training_s(a, sp, per_token, sz["shard"], 8)
    assert train < 2 * 3600 and costs["flop"] > flops / sp.flops
    runs, notes = ks.plan(a, [], tmp_path / "template", sp)
    assert all(r.seconds < 3 * 3600 for r in runs) and not any("over the limit" in n for n in notes)
    # where a run cannot fit, the plan says by how much and the HellaSwag tasks that would fit it
    a.sitting_hours = 1.8
    runs, notes = ks.plan(a, [], tmp_path / "template", sp)
    over = [n for n in notes if "over the limit" in n]
    assert over and all("--hellaswag-tasks" in n or "cannot fit" in n for n in over)


def test_summary_pairs_each_method_with_its_seeds_base_across_runs(tmp_path):
    out = tmp_path / "ks.jsonl"
    rows = [p1(1, 0.45), p1(2, 0.60), p1(4, 0.60), p1(8, 0.55),
            *[p2(s, m) for s in (1, 2) for m in ("moe", "flop", "lora", "lora-domain")]]
    out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    res = json.loads(subprocess.run([sys.executable, str(SCRIPT), "--out", str(out), "--summarise"],
                                    capture_output=True, text=True, check=True).stdout.splitlines()[-1])
    assert res["rows"] == 12 and res["chosen"] == 2
    s = ks.summarize(ks.load_rows(out))
    assert s["phase2"]["seeds"] == [1, 2] and s["phase2"]["epochs"] == 4
    assert ks.summarize(rows[:2], [1, 2, 4, 8])["chosen"] is None  # phase 1 half run: nothing chosen yet
    assert ks.summarize(rows[:4], [1, 2, 4, 8])["chosen"] == 2
    m = s["phase2"]["methods"]
    tt = {k: v["questions-train-test"] for k, v in m.items()}
    # paired over the same 40 tasks, each method's run against its seed's base from the moe run
    assert tt["moe"]["accuracy"]["mean"] == pytest.approx(0.725) and tt["moe"]["points"]["mean"] == pytest.approx(32.5)
    assert tt["flop"]["points"]["min"] == pytest.approx(20) and tt["flop"]["points"]["max"] == pytest.approx(22.5)
    assert all(lo > 0 for lo, _ in tt["moe"]["intervals"]) and tt["moe"]["verdict"] == "gain"
    assert tt["flop"]["verdict"] == "gain" and tt["lora"]["verdict"] == "within the noise"  # +5 / -2.5
    assert tt["moe"]["mcnemar_p"][0] < 0.01
    # the MoE against each method, paired across their two runs: lora +25/+37.5, lora-domain +5/0
    assert tt["lora"]["vs_moe"]["points"]["mean"] == pytest.approx(31.25)
    assert tt["lora"]["vs_moe"]["verdict"] == "MoE ahead" and tt["lora-domain"]["vs_moe"]["verdict"] == "within the noise"
    assert m["moe"]["questions-test"]["verdict"] == "within the noise"  # every model alike there
    md = out.with_suffix(".md").read_text()
    assert "| 2 (chosen) | 12/20 | 60.0% |" in md and "CPU: AMD EPYC (AVX2-only, 2 cores)." in md
    assert f"| {ks.NAMES['moe']} | 72.5 (70.0 to 75.0) | +32.5 (+30.0 to +35.0) |" in md
    assert out.with_suffix(".png").stat().st_size > 10_000
    one = [p2(1, "moe"), p2(1, "lora")]
    assert ks.summarize(one)["phase2"]["methods"]["moe"]["questions-train-test"]["verdict"] == "one seed"
    # another question file (a template made with other questions) is not paired: that benchmark is left out
    other = p2(2, "flop")
    other["models"]["flop"]["questions-train-test"]["data_sha256"] = "q2"
    s2 = ks.summarize([*rows[4:], other])
    assert "questions-train-test" not in s2["phase2"]["methods"]["flop"]
    assert "questions-test" in s2["phase2"]["methods"]["flop"]


def test_verdict_needs_two_seeds_a_mean_beyond_the_spread_and_every_interval_clear_of_zero():
    assert ks.verdict([5.0], [[1.0, 9.0]]) == "one seed"
    assert ks.verdict([5.0, 6.0], [[1.0, 9.0], [2.0, 10.0]]) == "gain"
    assert ks.verdict([5.0, 6.0], [[-1.0, 9.0], [2.0, 10.0]]) == "within the noise"  # one interval spans zero
    assert ks.verdict([1.0, 9.0], [[0.5, 2.0], [5.0, 12.0]]) == "within the noise"  # spread 8 > mean 5
    assert ks.verdict([-5.0, -6.0], [[-9.0, -1.0], [-10.0, -2.0]]) == "loss"
