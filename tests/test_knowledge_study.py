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


def bench(acc: float, base: float, half: float, moe: float | None = None) -> dict:
    """A benchmark's figures: accuracy, its paired difference to the base (interval +- half), and to the MoE."""
    pts = 100 * (acc - base)
    out = {"accuracy": acc, "tasks": 40, "points": pts, "low": pts - half, "high": pts + half, "mcnemar_p": 0.05}
    if moe is not None:
        d = 100 * (moe - acc)
        out["moe_minus"] = {"points": d, "low": d - half, "high": d + half, "mcnemar_p": 0.05}
    return out


# seed -> method -> questions-train-test accuracy; the base at 0.40 in both seeds
ACC = {1: {"moe": 0.70, "flop": 0.62, "lora": 0.45, "lora-domain": 0.66, "base": 0.40},
       2: {"moe": 0.74, "flop": 0.60, "lora": 0.39, "lora-domain": 0.75, "base": 0.40}}


def p2(seed: int) -> dict:
    a = ACC[seed]
    methods = {m: {"label": m, "flops": 1e14, "ppl_test_trained": 3.0 + (m == "base"), "ppl_test_untrained": 9.0,
                   "questions-train-test": bench(v, a["base"], 8.0, None if m in ("moe", "base") else a["moe"]),
                   "questions-test": bench(0.5, 0.5, 12.0)} for m, v in a.items()}
    return {"phase": 2, "run": f"p2-e4-s{seed}", "epochs": 4, "seed": seed, "methods": methods, "machines": [EPYC],
            "recipe": {"base": "smollm2", "domains": ["man", "python"]}}


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
    for name in ("p1-e1", "p1-e2", "p1-e4", "p1-e8", "p2-e8-s1", "p2-e8-s2"):
        assert any(l.startswith(f"# {name}: phase ") and " h" in l for l in lines), name
    experts = [l for l in lines if l.startswith("mfgguf train-expert ")]
    # phase 1's four runs and the second seed's experts; the first seed's phase 2 reuses phase 1's
    assert len(experts) == 2 * 5 and {l.split("--expert ")[1].split()[0] for l in experts} == {"4", "5"}
    assert f"--tokens {8 * shard}" in next(l for l in experts if "/p1-e8 " in l)
    assert all("--seed 2" in l for l in experts if "/p2-" in l)
    assert sum(l.startswith("mfgguf import-base ") for l in lines) == 1
    assert sum("base.gguf --hellaswag" in l for l in lines) == 1  # the base scored once
    assert any(l.startswith("mfgguf perplexity ") and "train-valid.txt" in l and "--paired-with" in l for l in lines)
    evals = [l for l in lines if l.startswith("mfgguf eval ")]
    assert len(evals) == 2 and all("--baselines flop,lora,lora-domain" in l and "--top-k 1" in l for l in evals)
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
    assert [r.name for r in p2runs] == ["p2-e8-s1", "p2-e8-s2"] and all(r.provisional for r in p2runs)
    assert p2runs[1].seconds > p2runs[0].seconds  # the second seed trains its experts, the first reuses phase 1's
    rows = [p1(1, 0.45), p1(2, 0.60), p1(4, 0.60), p1(8, 0.55)]
    runs, _ = ks.plan(a, rows, tmp_path / "template", ks.SPEEDS["AVX2-only"])
    assert [r.name for r in runs] == ["p2-e2-s1", "p2-e2-s2"] and not any(r.provisional for r in runs)


def test_summary_means_paired_intervals_and_verdicts_beyond_the_seeds_spread(tmp_path):
    out = tmp_path / "ks.jsonl"
    rows = [p1(1, 0.45), p1(2, 0.60), p1(4, 0.60), p1(8, 0.55), p2(1), p2(2)]
    out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    res = json.loads(subprocess.run([sys.executable, str(SCRIPT), "--out", str(out), "--summarise"],
                                    capture_output=True, text=True, check=True).stdout.splitlines()[-1])
    assert res["rows"] == 6 and res["chosen"] == 2
    s = ks.summarize(ks.load_rows(out))
    m = s["phase2"]["methods"]
    tt = {k: v["questions-train-test"] for k, v in m.items()}
    assert tt["moe"]["accuracy"]["mean"] == pytest.approx(0.72) and tt["moe"]["points"]["mean"] == pytest.approx(32)
    assert tt["moe"]["intervals"] == [[pytest.approx(22), pytest.approx(38)], [pytest.approx(26), pytest.approx(42)]]
    # the MoE +30/+34 (spread 4, intervals above zero): a gain; flop +22/+20: a gain; lora +5/-1: spread 6 > mean 2
    assert tt["moe"]["verdict"] == "gain" and tt["flop"]["verdict"] == "gain"
    assert tt["lora"]["verdict"] == "within the noise"
    # lora-domain +26/+35: mean 30.5 beyond the spread 9 and both intervals above zero
    assert tt["lora-domain"]["verdict"] == "gain"
    # MoE - method: flop +8/+14 (spread 6 < mean 11; intervals +-8: the first touches zero): within the noise
    assert tt["flop"]["vs_moe"]["points"]["mean"] == pytest.approx(11)
    assert tt["flop"]["vs_moe"]["verdict"] == "within the noise"
    assert tt["lora"]["vs_moe"]["verdict"] == "MoE ahead"  # +25/+35: spread 10, intervals above zero
    assert tt["lora-domain"]["vs_moe"]["verdict"] == "within the noise"  # +4/-1
    assert m["moe"]["questions-test"]["verdict"] == "within the noise"  # no difference at all
    md = out.with_suffix(".md").read_text()
    assert "| 2 (chosen) | 12/20 | 60.0% |" in md and "CPU: AMD EPYC (AVX2-only, 2 cores)." in md
    assert f"| {ks.NAMES['moe']} | 72.0 (70.0 to 74.0) | +32.0 (+30.0 to +34.0) |" in md
    assert out.with_suffix(".png").stat().st_size > 10_000
    one = [p2(1)]
    assert ks.summarize(one)["phase2"]["methods"]["moe"]["questions-train-test"]["verdict"] == "one seed"


def test_verdict_needs_two_seeds_a_mean_beyond_the_spread_and_every_interval_clear_of_zero():
    assert ks.verdict([5.0], [[1.0, 9.0]]) == "one seed"
    assert ks.verdict([5.0, 6.0], [[1.0, 9.0], [2.0, 10.0]]) == "gain"
    assert ks.verdict([5.0, 6.0], [[-1.0, 9.0], [2.0, 10.0]]) == "within the noise"  # one interval spans zero
    assert ks.verdict([1.0, 9.0], [[0.5, 2.0], [5.0, 12.0]]) == "within the noise"  # spread 8 > mean 5
    assert ks.verdict([-5.0, -6.0], [[-9.0, -1.0], [-10.0, -2.0]]) == "loss"
