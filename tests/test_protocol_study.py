"""scripts/studies/protocol_study.py: its summary from study.jsonl rows, and the commands and costs --dry-run prints.

No study is trained here: the summary reads a synthetic study.jsonl of two sizes and two seeds whose figures are
chosen so that each rule shows (a verdict within the spread, one beyond it, the MoE's mean ahead but not by more
than the spread), and --dry-run runs nothing.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "studies" / "protocol_study.py"
sys.path[:0] = [str(ROOT / "scripts" / "studies"), str(ROOT / "scripts" / "bench")]

import protocol_study as ps  # noqa: E402

# size -> seed -> method -> mixed test perplexity on the trained domains; the MoE chosen on validation is top-2 for
# seed 1 and top-1 for seed 2 (its figure is the first of the two)
PPL = {65536: {1: {"moe top-1": 3.45, "moe top-2": 3.40, "flop": 3.41, "lora": 3.30, "base": 4.50},
               2: {"moe top-1": 3.44, "moe top-2": 3.47, "flop": 3.43, "lora": 3.34, "base": 4.50}},
       262144: {1: {"moe top-1": 3.15, "moe top-2": 3.10, "flop": 3.20, "lora": 3.15, "base": 4.50},
                2: {"moe top-1": 3.12, "moe top-2": 3.13, "flop": 3.30, "lora": 3.25, "base": 4.50}}}
CHOSEN = {1: "moe top-2", 2: "moe top-1"}
EPYC = {"model": "AMD EPYC", "flags": ["avx2", "fma", "avx512f", "avx512_bf16"], "cores": 2}
XEON = {"model": "Intel(R) Xeon(R) Processor", "flags": ["avx2", "amx_tile"], "cores": 2}
# the 262,144-token point's first seed ran its sittings on two machines
MACHINES = {(65536, 1): [EPYC], (65536, 2): [EPYC], (262144, 1): [XEON, EPYC], (262144, 2): [XEON]}


def row(tokens: int, seed: int) -> dict:
    moe_flops = 4 * tokens * 697e6
    flops = {"moe top-1": moe_flops, "moe top-2": moe_flops, "flop": moe_flops, "lora": moe_flops, "base": 0.0}
    methods = {m: {"label": m, "ppl_trained": p, "ppl_held_out": 11.0 + p / 10, "ppl_all": p + 1, "flops": flops[m],
                   "wall_s": 100.0 * tokens / 65536} for m, p in PPL[tokens][seed].items()}
    return {"tokens_per_domain": tokens, "seed": seed, "run": f"t{tokens}-s{seed}", "trained_domains": ["c", "cpp"],
            "held_out": "english", "moe_chosen": CHOSEN[seed], "moe_chosen_top1": "moe top-1", "methods": methods,
            "goals": {"moe_over_flop_dense_mixed": 1.01 - tokens / 1e7}, "test_split_sha256": "ab" * 32,
            "recipe": {"base": "smollm2", "expert_ff": 768, "rounds": 4}, "machines": MACHINES[tokens, seed]}


@pytest.fixture
def study(tmp_path) -> Path:
    stale = {**row(65536, 1), "methods": {}}  # an earlier line of the same run: the last one wins
    lines = [json.dumps(stale)] + [json.dumps(row(t, s)) for t in PPL for s in (1, 2)]
    (tmp_path / "study.jsonl").write_text("\n".join(lines) + "\n")
    return tmp_path


def cells(md: str, size: int, method: str) -> list[str]:
    """The table row of `method` under size `size`'s heading, as its cells."""
    part = md.split(f"## {size:,} tokens a domain")[1].split("\n## ")[0]
    line = next(l for l in part.splitlines() if l.startswith(f"| {ps.NAMES[method]} |"))
    return [c.strip() for c in line.strip("|").split("|")]


def test_summary_means_spreads_verdicts_and_crossover(study):
    out = subprocess.run([sys.executable, str(SCRIPT), "--out", str(study), "--summary-only"], capture_output=True,
                         text=True, check=True).stdout
    res = json.loads(out.splitlines()[-1])
    assert res["rows"] == 4
    md = (study / "study.md").read_text()
    # the MoE chosen on validation: 3.40 (top-2, seed 1) and 3.44 (top-1, seed 2)
    assert cells(md, 65536, "moe")[1:3] == ["3.4200", "3.4000-3.4400"]
    assert cells(md, 65536, "moe top-1")[1:3] == ["3.4450", "3.4400-3.4500"]
    # flop 3.41/3.43: level; lora 3.30/3.34: 0.10 better than the MoE, beyond the 0.04 spread; the base far behind
    flop, lora, base = (cells(md, 65536, m) for m in ("flop", "lora", "base"))
    assert flop[1:3] == ["3.4200", "3.4100-3.4300"] and flop[-1] == "within the spread"
    assert flop[11:13] == [f"{(3.40 / 3.41 + 3.44 / 3.43) / 2:.4f}", f"{3.40 / 3.41:.4f}-{3.44 / 3.43:.4f}"]
    assert lora[-1] == "behind" and base[-1] == "ahead"
    # the headline at top-1 (3.45, 3.44): 0.025 behind flop's mean, beyond the wider range (0.02)
    assert cells(md, 65536, "moe@1")[1:3] == ["3.4450", "3.4400-3.4500"]
    assert flop[8:11] == [f"{(3.45 / 3.41 + 3.44 / 3.43) / 2:.4f}", f"{3.44 / 3.43:.4f}-{3.45 / 3.41:.4f}", "behind"]
    # at 262,144: flop's mean is 0.14 above the MoE's, beyond the wider range (0.10): ahead; lora's 0.09 is not
    assert cells(md, 262144, "flop")[-1] == "ahead"
    assert cells(md, 262144, "lora")[-1] == "within the spread"
    cross = md.split("## Where the MoE passes each method")[1]
    assert f"| {ps.NAMES['flop']} | 262,144 | within the spread | ahead |" in cross
    assert f"| {ps.NAMES['lora']} | not reached | behind | within the spread |" in cross
    assert f"| {ps.NAMES['base']} | 65,536 | ahead | ahead |" in cross
    assert res["crossover"] == {"flop": 262144, "lora": None, "base": 65536}
    assert res["crossover_top1"] == {"flop": 262144, "lora": None, "base": 65536}  # 3.135 against 3.25 and 3.20
    assert "Every row scored the same test split" in md and "moe_over_flop_dense_mixed" in md
    small, large = md.split("## 65,536 tokens a domain")[1], md.split("## 262,144 tokens a domain")[1]
    assert "CPU: AMD EPYC (avx2, fma, avx512f, avx512_bf16; 2 cores)." in small.split("\n|")[0]
    assert "more than one" not in small.split("## ")[0]
    assert "t262144-s1 ran on more than one: their walls mix machines." in large.split("\n|")[0]
    assert (study / "study.png").stat().st_size > 10_000  # a plot, not an empty figure


def test_a_run_records_each_cpu_that_worked_on_it_once(tmp_path):
    ps.note_machine(tmp_path)
    ps.note_machine(tmp_path)  # the same machine again: nothing new
    here = json.loads((tmp_path / "machines.json").read_text())
    assert len(here) == 1 and here[0]["cores"] >= 1 and here[0]["model"]
    (tmp_path / "machines.json").write_text(json.dumps([EPYC] if here[0] != EPYC else [XEON]))
    ps.note_machine(tmp_path)  # a later sitting on this machine
    seen = json.loads((tmp_path / "machines.json").read_text())
    assert len(seen) == 2 and seen[1] == here[0]


def test_verdict_needs_two_seeds_and_a_margin_beyond_the_spread():
    one = ps.spread([3.0])
    assert ps.verdict(one, ps.spread([4.0])) == "one seed"
    moe = ps.spread([3.00, 3.02])
    assert ps.verdict(moe, ps.spread([3.05, 3.06])) == "ahead"  # 0.045 > 0.02
    assert ps.verdict(moe, ps.spread([3.02, 3.05])) == "within the spread"  # 0.025 < 0.03, the wider range
    assert ps.verdict(moe, ps.spread([2.90, 2.95])) == "behind"


def test_a_resumed_baselines_wall_counts_the_killed_process_too():
    whole = {"wall_s": 100.0, "train_s": 90.0, "tokens_per_s": 1000.0, "tokens_seen": 90_000, "resumed_from_step": 0}
    assert ps.training_wall(whole) == (100.0, False)
    # killed after 60,000 tokens; the record, from before the count was kept, saw only the last 30,000
    old = {**whole, "wall_s": 40.0, "train_s": 30.0, "resumed_from_step": 6}
    assert ps.training_wall(old) == (pytest.approx(100.0), True)
    # a record that counted them: its wall as it stands
    assert ps.training_wall({**old, "wall_s": 100.0, "resumed_train_s": 60.0}) == (100.0, False)
    # the process's start before the training's clock (imports) is part of the wall, estimated or not
    assert ps.training_wall({**whole, "startup_s": 3.5}) == (103.5, False)
    assert ps.training_wall({**old, "startup_s": 3.5}) == (pytest.approx(103.5), True)


def test_dry_run_prints_the_commands_and_runs_nothing(tmp_path):
    out = tmp_path / "study"
    args = [sys.executable, str(SCRIPT), "--out", str(out), "--base", str(tmp_path / "no-base.gguf"),
            "--tokens", "4096", "--seeds", "3", "--rounds", "2", "--dry-run"]
    text = subprocess.run(args, capture_output=True, text=True, check=True).stdout
    assert not out.exists()
    lines = text.splitlines()
    assert any(l.startswith("mfgguf import-base ") and "--expert-ff 768" in l for l in lines)
    prep = next(l for l in lines if l.startswith("mfgguf prepare study "))
    assert "--seed 0" in prep and "--partition label" in prep  # the data's seed is fixed, not the study's
    experts = [l for l in lines if l.startswith("mfgguf train-expert ")]
    assert len(experts) == 2 * 4 and all("--tokens 4096" in l and "--seed 3" in l and "--rounds 2" in l for l in experts)
    assert sorted({int(l.split("--expert ")[1].split()[0]) for l in experts}) == [1, 2, 4, 5]  # english (3) held out
    assert [l for l in lines if l.startswith("mfgguf sync ")] == [f"mfgguf sync {out / 't4096-s3'} --experts 1,2,4,5"
                                                                  " --no-progress"] * 2
    ev = next(l for l in lines if l.startswith("mfgguf eval "))
    assert "--seed 3" in ev and "--baselines flop,lora,lora-domain,wallclock" in ev and "--quants ''" in ev
    assert "cost unknown" in text
    only = subprocess.run([*args, "--train-only"], capture_output=True, text=True, check=True).stdout.splitlines()
    assert [l for l in only if l.startswith("mfgguf ")] == [l for l in lines if l.startswith("mfgguf ") and l != ev]


def test_dry_run_costs_a_run_from_the_template_trunk(tmp_path):
    """With the base imported, --dry-run prices a run: SmolLM2's shape with 768-unit experts and attention copies
    gives docs/studies/protocol.md's 697.3 MFLOP a training token and 1.83e14 FLOPs for four experts of 65,536 tokens."""
    from mfgguf.base.importer import trunk_config
    from mfgguf.base.source import BaseShape

    smollm2 = BaseShape(dim=576, n_layers=30, n_heads=9, n_kv_heads=3, ff=1536, vocab_size=49152, rope_theta=1e5,
                        norm_eps=1e-5, ctx_len=8192, tied=True)
    cfg = trunk_config(smollm2, expert_ff=768)
    e = ps.estimate(cfg, 65536, 4, 4, "attn", ps.IMPORTED_BASELINES.split(","), 32768)
    assert round(e["expert_flops_per_token"] / 1e6, 1) == 697.3 and f"{e['moe_flops']:.3e}" == "1.828e+14"
    assert e["baseline_flops"] > 7 * e["moe_flops"]  # two LR grids of three points, each at the experts' FLOPs
    gated = ps.estimate(cfg, 65536, 4, 4, "attn", ps.IMPORTED_BASELINES.split(","), 32768, gated_moes=6)
    assert gated["seconds"] == pytest.approx(e["seconds"] + 6 * ps.MOE_MEASURE_S)  # eval --seed-gates' MoEs scored
    trunk = tmp_path / "study" / "template" / "modules" / "trunk.json"
    trunk.parent.mkdir(parents=True)
    trunk.write_text(json.dumps({"config": cfg.to_dict()}))
    text = subprocess.run([sys.executable, str(SCRIPT), "--out", str(tmp_path / "study"), "--tokens", "65536",
                           "--seeds", "1,2", "--dry-run"], capture_output=True, text=True, check=True).stdout
    assert "mfgguf import-base" not in text and "mfgguf prepare study" in text
    assert text.count("MoE 1.828e+14 training FLOPs (697.3 MFLOP a token)") == 2
    assert f"about {2 * e['seconds'] / 3600:.1f} h in all" in text
    # a later seed on the LRs chosen before: one point a grid, four of the six grid trainings saved
    one = ps.estimate(cfg, 65536, 4, 4, "attn", ps.IMPORTED_BASELINES.split(","), 32768, grid_points=(1, 1))
    assert one["baseline_flops"] == pytest.approx(e["baseline_flops"] - 4 * e["moe_flops"])
    text = subprocess.run([sys.executable, str(SCRIPT), "--out", str(tmp_path / "study"), "--tokens", "65536",
                           "--seeds", "2", "--full-lrs", "3e-4", "--lora-lrs", "3e-3", "--dry-run"],
                          capture_output=True, text=True, check=True).stdout
    ev = next(l for l in text.splitlines() if l.startswith("mfgguf eval "))
    assert ev.endswith("--seed 2 --full-lrs 3e-4 --lora-lrs 3e-3") and f"about {one['seconds'] / 3600:.1f} h" in text
    # a study resumed with another recipe would mix two studies in one table: refused in one line
    (tmp_path / "study" / "study.jsonl").write_text(json.dumps({**row(65536, 1), "recipe": {"rounds": 2}}) + "\n")
    r = subprocess.run([sys.executable, str(SCRIPT), "--out", str(tmp_path / "study"), "--dry-run"], capture_output=True,
                       text=True)
    assert r.returncode == 1 and r.stderr.count("\n") == 1 and "another recipe" in r.stderr


def test_a_finished_runs_line_reads_its_report_and_records(tmp_path):
    """result_row on a RUN shaped as eval leaves it (report.json's keys as eval/evaluate.py writes them): the trained
    mix token-weighted over the trained domains, the MoE chosen on validation, each method's FLOPs and walls."""
    from mfgguf.run import MODULE_FORMAT, MODULE_VERSION

    run = tmp_path / "t4096-s1"

    def module(root: Path, name: str, **meta) -> None:
        (root / "modules").mkdir(parents=True, exist_ok=True)
        (root / "modules" / f"{name}.safetensors").write_bytes(b"")
        (root / "modules" / f"{name}.json").write_text(json.dumps({"format": MODULE_FORMAT, "version": MODULE_VERSION,
                                                                   **meta}))

    from mfgguf.config import ModelConfig

    cfg = ModelConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, anchor_ff=96, expert_ff=32, seed_expert=True)
    module(run, "trunk", kind="trunk", config=cfg.to_dict())
    module(run, "expert_001", kind="expert", round=1, wall_s=30.0)
    module(run, "expert_002", kind="expert", round=1, wall_s=46.0, startup_s=4.0)  # its process's imports count too
    for name, wall in (("grid-full-lr0.0003", 67.0), ("lora-shard1", 20.0), ("lora-shard2", 25.0)):
        module(run / "eval" / name, "trunk", kind="trunk", wall_s=wall, **({"startup_s": 3.0} if wall == 67.0 else {}))
    (run / "data" / "test").mkdir(parents=True)
    (run / "data" / "test" / "c.npy").write_bytes(b"c")
    (run / "run.json").write_text(json.dumps({
        "shards": [{"id": 1, "tokens": 9000, "domains": {"c": 9000}}, {"id": 2, "tokens": 8000, "domains": {"cpp": 8000}},
                   {"id": 3, "tokens": 7000, "domains": {"english": 7000}}],
        "test": {d: {"docs": 3, "tokens": 100} for d in ("c", "cpp", "english")}}))

    def res(c: float, cpp: float, en: float) -> dict:  # per-domain nll; c scores 300 tokens, cpp 100
        doms = {d: {"ppl": math.exp(v), "nll": v, "n_tokens": n} for d, v, n in (("c", c, 300), ("cpp", cpp, 100),
                                                                                 ("english", en, 200))}
        return {"domains": doms, "overall": {"ppl": 9.9}}

    lora_d = "a LoRA per domain"
    report = {
        "best": "moe ridge top-2", "wall_s": 500.0, "goals": {"moe_over_flop_dense_mixed": 0.99},
        "models": {"moe ridge top-1": {"kind": "moe", "router": "ridge", "top_k": 1},
                   "moe ridge top-2": {"kind": "moe", "router": "ridge", "top_k": 2},
                   "trunk alone": {"kind": "trunk"}, "trunk as trained (before sync)": {"kind": "trunk"},
                   "oracle c": {"kind": "oracle", "domains": ["c"]},
                   "base, continued pretraining, FLOP-matched": {"kind": "dense", "baseline": "flop"},
                   lora_d: {"kind": "dense", "baseline": "lora-domain"}},
        "results": {"moe ridge top-1": res(1.0, 2.0, 2.5), "moe ridge top-2": res(1.1, 1.9, 2.4),
                    "trunk alone": res(1.2, 2.1, 2.5), "trunk as trained (before sync)": res(1.3, 2.2, 2.6),
                    "oracle c": res(1.0, 2.0, 2.5), "base, continued pretraining, FLOP-matched": res(1.05, 1.95, 2.45),
                    lora_d: res(1.0, 2.1, 2.6)},
        "flops": {"models": {"moe (trunk + every expert)": {"flops": 4e12},
                             "base, continued pretraining, FLOP-matched": {"flops": 3.9e12}, lora_d: {"flops": 4.1e12}}},
        "base_baselines": {"plans": [
            {"key": "flop", "run": str(run / "eval" / "grid-full-lr0.0003"), "lr": 3e-4},
            {"key": "lora-domain", "run": str(run), "lr": 3e-3,
             "adapters": [{"shard": i, "run": str(run / "eval" / f"lora-shard{i}")} for i in (1, 2)]}]}}
    (run / "eval" / "report.json").write_text(json.dumps(report))
    a = ps.parse(["--domains", "c,cpp", "--held-out", "english"])
    r = ps.result_row(a, run, 4096, 1, {"c": 1, "cpp": 2})
    m = r["methods"]
    assert set(m) == {"moe top-1", "moe top-2", "flop", "lora-domain", "base"} and r["moe_chosen"] == "moe top-2"
    assert m["moe top-1"]["ppl_trained"] == pytest.approx(math.exp((300 * 1.0 + 100 * 2.0) / 400))
    assert m["moe top-2"]["ppl_held_out"] == pytest.approx(math.exp(2.4))
    assert m["base"]["ppl_trained"] == pytest.approx(math.exp((300 * 1.3 + 100 * 2.2) / 400))  # the base, not the merge
    assert (m["moe top-1"]["flops"], m["flop"]["flops"], m["base"]["flops"]) == (4e12, 3.9e12, 0.0)
    assert (m["moe top-2"]["wall_s"], m["moe top-2"]["critical_path_s"]) == (80.0, 50.0)  # no sync in this RUN
    assert (m["flop"]["wall_s"], m["lora-domain"]["wall_s"]) == (70.0, 45.0)
    assert r["shard_tokens"] == {"c": 9000, "cpp": 8000} and r["test_tokens"]["english"] == 100
    assert r["goals"] == report["goals"] and len(r["test_split_sha256"]) == 64
    # what each costs to serve: top-2 runs one more expert FFN and both run a router of two rows; the domain
    # LoRAs add two adapters' parameters and one adapter's arithmetic; the base's figures are continued pretraining's
    from mfgguf.flops import served_flops, served_params

    assert m["moe top-2"]["serve_mflop_per_token"] * 1e6 == served_flops(cfg, ffns=2, routed=2)
    assert m["moe top-1"]["params"] == m["moe top-2"]["params"] == served_params(cfg, ffns=2, routed=2)
    assert m["flop"]["params"] == m["base"]["params"] == served_params(cfg) < m["lora-domain"]["params"]
    assert m["lora-domain"]["serve_mflop_per_token"] > m["flop"]["serve_mflop_per_token"]
    # eval --seed-gates' MoEs are methods of their own, and one of them may be the MoE validation chose
    gated = "moe ridge seed-gate 0.6 top-1"
    report["models"][gated] = {"kind": "moe", "router": "ridge", "top_k": 1, "seed_gate": 0.6}
    report["results"][gated], report["best"] = res(1.0, 2.0, 2.3), gated
    (run / "eval" / "report.json").write_text(json.dumps(report))
    r = ps.result_row(a, run, 4096, 1, {"c": 1, "cpp": 2})
    assert r["moe_chosen"] == "moe top-1 seed-gate 0.6" and r["methods"]["moe top-1"]["ppl_held_out"] == pytest.approx(math.exp(2.5))
    assert r["moe_chosen_top1"] is None  # no validation figures in this report: no top-1 choice made
    report["validation"] = {"moe ridge top-1": {"ppl": 4.0}, "moe ridge top-2": {"ppl": 3.0}, gated: {"ppl": 3.9}}
    (run / "eval" / "report.json").write_text(json.dumps(report))
    r = ps.result_row(a, run, 4096, 1, {"c": 1, "cpp": 2})
    assert r["moe_chosen_top1"] == "moe top-1 seed-gate 0.6"  # the lower validation figure among the top-1 MoEs
    # a line written before it held the top-1 choice is made again from the same report; one of another recipe stops
    old = {k: v for k, v in r.items() if k != "moe_chosen_top1"}
    (tmp_path / "study.jsonl").write_text(json.dumps(old) + "\n")
    assert ps.rerow(a, tmp_path, {"c": 1, "cpp": 2}) == 1
    assert ps.load_rows(tmp_path / "study.jsonl") == [json.loads(json.dumps(r))]
    (tmp_path / "study.jsonl").write_text(json.dumps({**old, "recipe": {"rounds": 2}}) + "\n")
    with pytest.raises(SystemExit, match="another recipe"):
        ps.rerow(a, tmp_path, {"c": 1, "cpp": 2})
    assert r["methods"][r["moe_chosen"]]["ppl_held_out"] == pytest.approx(math.exp(2.3))
    summ = ps.summarize([r])["sizes"][4096]
    assert "moe top-1 seed-gate 0.6" in summ["methods"] and "moe top-1 seed-gate 0.6" not in summ["verdicts"]
    # a gate validation turned down is assembled and on validation, but test never scored it: no method; and a
    # variant another seed did not score is no row of the summary (its mean would be over the seeds it won)
    report["models"]["moe ridge seed-gate 0.4 top-1"] = {"kind": "moe", "router": "ridge", "top_k": 1, "seed_gate": 0.4}
    report["validation"]["moe ridge seed-gate 0.4 top-1"] = {"ppl": 3.95}
    (run / "eval" / "report.json").write_text(json.dumps(report))
    r2 = ps.result_row(a, run, 4096, 2, {"c": 1, "cpp": 2})
    assert "moe top-1 seed-gate 0.4" not in r2["methods"] and r2["moe_chosen_top1"] == "moe top-1 seed-gate 0.6"
    r2["methods"].pop("moe top-2")
    summ = ps.summarize([r, r2])["sizes"][4096]
    assert "moe top-2" not in summ["methods"] and summ["methods"]["moe top-1"]["ppl_trained"]["n"] == 2


def test_every_run_is_the_template_hard_linked(tmp_path):
    """The data of every size and seed is the template's own files (a stage replaces a file, never writes into it),
    except a lock file, which is opened to append."""
    t = tmp_path / "template"
    (t / "data" / "test").mkdir(parents=True)
    (t / "data" / "test" / "c.npy").write_bytes(b"tokens")
    (t / "manifest.lock").write_text("")
    run = tmp_path / "t4096-s1"
    ps.copy_template(t, run)
    assert (run / "data" / "test" / "c.npy").stat().st_ino == (t / "data" / "test" / "c.npy").stat().st_ino
    assert not (run / "manifest.lock").exists() and not (tmp_path / "t4096-s1.tmp").exists()
    assert ps.split_digest(run) == ps.split_digest(t)


def test_a_template_whose_splits_cannot_fill_a_window_stops_before_training(trained_run):
    """eval's own split check on the template: scoring at most 10 tokens a domain fills no window, so the study
    stops at once, in one line, instead of after its experts and baselines trained; the real cap passes."""
    ps.check_splits(trained_run, 4096)
    with pytest.raises(SystemExit, match="fewer than one perplexity window"):
        ps.check_splits(trained_run, 10)


def test_hellaswag_figures_are_summarised_over_seeds_beside_the_base(tmp_path):
    """A row's methods carry eval's HellaSwag figures (general_figures); the summary gives each method's mean accuracy
    and paired difference to the base over seeds, each seed's interval beside them."""
    points = {1: {"moe top-1": -0.3, "moe top-2": -0.1, "flop": -1.2, "lora": -0.6, "base": 0.0},
              2: {"moe top-1": -0.5, "moe top-2": 0.2, "flop": -0.8, "lora": -0.4, "base": 0.0}}
    rows = []
    for s in (1, 2):
        r = row(65536, s)
        for m, v in r["methods"].items():
            v["hellaswag"] = {"accuracy": 0.40 + points[s][m] / 100, "tasks": 2000, "points": points[s][m],
                              "low": points[s][m] - 0.9, "high": points[s][m] + 0.9, "mcnemar_p": 0.5}
        rows.append(r)
    (tmp_path / "study.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    ps.write_summary(tmp_path)
    md = (tmp_path / "study.md").read_text()
    part = md.split("## General ability at 65,536 tokens a domain: HellaSwag")[1]
    flop = next(l for l in part.splitlines() if l.startswith(f"| {ps.NAMES['flop']} |"))
    assert "| 39.00% | 38.80-39.20 | -1.00 | -1.20--0.80 | -2.10 to -0.30; -1.70 to +0.10 |" in flop
    assert "2,000 tasks" in part and "(the base)" in part
    rep = {"general": {"hellaswag": {"tasks": 2000, "models": {"m": {"accuracy": 0.41}, "b": {"accuracy": 0.40}},
                                     "paired": {"m": {"points": 1.0, "low": 0.1, "high": 1.9, "mcnemar_p": 0.03}}}}}
    assert ps.general_figures(rep, "m")["hellaswag"]["points"] == 1.0
    assert ps.general_figures(rep, "b")["hellaswag"] == {"accuracy": 0.40, "tasks": 2000, "points": 0.0, "low": 0.0,
                                                         "high": 0.0, "mcnemar_p": 1.0}
