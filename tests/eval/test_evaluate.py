"""`mfgguf eval` on the tiny trained run: every model really assembled and measured by llama.cpp."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from mfgguf.cli.app import app
from mfgguf.eval.training_flops import run_flops
from mfgguf.run import RunDir, read_module, read_module_meta

QUANTS = "q8_0,q4_k"  # quantized copies compared with f16
DENSE = {"flop": "dense, FLOP-matched", "wallclock": "dense, wall-clock-matched",
         "total": "dense, total params, FLOP-matched"}


def test_eval_report(trained_run, tmp_path):
    out = tmp_path / "eval"
    r = CliRunner().invoke(app, ["eval", str(trained_run), "--out", str(out), "--routers", "ridge,uniform",
                                 "--top-k", "1,2", "--max-tokens", "2048", "--quants", QUANTS])
    assert r.exit_code == 0, r.output
    rep = json.loads((out / "report.json").read_text())
    res = rep["results"]
    domains = rep["domains"]
    for name in ("moe ridge top-1", "moe ridge top-2", "moe uniform top-1", "trunk alone", *DENSE.values()):
        assert name in res, name
        assert set(res[name]["domains"]) == set(domains)
        assert res[name]["peak_rss_mb"] > 10 and res[name]["decode_tps"] > 0
    for d in domains:
        assert set(res[f"oracle {d}"]["domains"]) == {d}

    # Dense baselines spend the modular run's FLOPs (all of them, or the critical path's) within one step.
    rd = RunDir(trained_run)
    metas = {i: read_module(rd, i) for i in range(4)}
    fl = run_flops(metas)
    cfg = metas[0].config
    budget = {"flop": fl["total"], "wallclock": fl["critical_path"], "total": fl["total"]}
    width = {"flop": cfg["anchor_ff"] + cfg["expert_ff"], "wallclock": cfg["anchor_ff"] + cfg["expert_ff"],
             "total": cfg["anchor_ff"] + 3 * cfg["expert_ff"]}
    for key, label in DENSE.items():
        m = read_module_meta(RunDir(out / f"dense-{key}"), 0)
        assert m["config"]["anchor_ff"] == width[key]
        step = m["flops_per_token"] * m["train"]["batch_size"] * cfg["ctx_len"]
        assert abs(m["train_flops"] - budget[key]) <= step, key
        assert rep["flops"]["models"][label]["flops"] == m["train_flops"]
        curve = rep["curves"][label]  # held-out curve: points every eval_every steps, then the end
        assert len(curve) >= 2 and [p[0] for p in curve] == sorted(p[0] for p in curve)
        assert curve[-1][0] == m["tokens_seen"] and curve[-1][1] == m["train_flops"]
        # trained with both LR schedules at the same tokens; the lower held-out loss is kept and named
        ds = rep["dense_schedules"][label]
        w = read_module_meta(RunDir(out / f"dense-{key}-wsd"), 0)
        assert w["train"]["schedule"] == "wsd" and w["tokens_seen"] == m["tokens_seen"]
        assert ds["validation_loss"] == {"cosine": m["validation_loss_mean"], "wsd": w["validation_loss_mean"]}
        assert ds["chosen"] == min(ds["validation_loss"], key=ds["validation_loss"].get) == rep["models"][label]["schedule"]
    assert fl["critical_path"] < fl["total"] and rep["flops"]["total"] == fl["total"] and rep["flops"]["rounds"] == 1
    assert len(rep["curves"]["trunk alone"]) >= 2 and "expert_step" in rep["flops"]["formulas"]

    g = rep["goals"]
    for key in ("moe_over_flop_dense_mixed", "moe_over_wallclock_dense_mixed", "moe_over_total_dense_mixed",
                "best_router_vs_oracle", "moe_beats_trunk_every_domain"):
        assert key in g, key
    assert g["moe_over_flop_dense_mixed"] == res[rep["best"]]["overall"]["ppl"] / res[DENSE["flop"]]["overall"]["ppl"]
    assert rep["best_stats_router"] == "moe ridge top-1" or rep["best_stats_router"] == "moe ridge top-2"
    for q in filter(None, QUANTS.split(",")):  # quantized copies of the best MoE stay close to f16 even when tiny
        assert abs(g[f"{q}_over_f16"] - 1) < 0.02
    # Routing accuracy per layer is a share in [0, 1] for every domain.
    acc = rep["routing"]["ridge"]["accuracy"]
    assert set(acc) == set(domains) and all(0 <= a <= 1 for v in acc.values() for a in v)
    md = (out / "report.md").read_text()
    assert "| trunk alone |" in md and "oracle routing" in md and "## Goals" in md and "## Training FLOPs" in md
    assert "## Dense baselines' LR schedules" in md
    assert "0.9x the wall-clock-matched dense model" in md and "1.0x the FLOP-matched dense model" in md
    for png in ("ppl_by_domain.png", "routing_confusion.png", "curves.png"):
        assert (out / png).read_bytes()[:4] == b"\x89PNG"


def test_eval_needs_a_run(tmp_path):
    r = CliRunner().invoke(app, ["eval", str(tmp_path)])
    assert r.exit_code == 1 and r.output.startswith("error:") and "Traceback" not in r.output
    r = CliRunner().invoke(app, ["eval", str(tmp_path), "--baselines", "flop,tokens"])
    assert r.exit_code == 1 and "unknown baseline 'tokens'" in r.output


def test_routing_accuracy_follows_the_files_experts_in_slot_order(trained_run, tmp_path):
    """An assembled subset (experts 3 and 1, in that slot order) is scored as its slots route, not as experts 1..N."""
    import numpy as np

    from mfgguf.converters.assemble import assemble
    from mfgguf.eval.measure import routing_accuracy

    rd = RunDir(trained_run)
    test = rd.test_tokens(1024)
    domains = list(test)
    full, sub = tmp_path / "full.gguf", tmp_path / "sub.gguf"
    assemble(trained_run, full, quant="f16", progress=False)
    assemble(trained_run, sub, quant="f16", experts=[3, 1], progress=False)
    ra_full, ra_sub = (routing_accuracy(rd, domains, test, g) for g in (full, sub))
    assert list(ra_full["expert_domain"]) == [1, 2, 3] and list(ra_sub["expert_domain"]) == [3, 1]
    conf = np.array(ra_sub["confusion"])  # domain x slot
    assert conf.shape == (len(domains), 2) and np.allclose(conf.sum(1), 1)
    home = ra_sub["expert_domain"]
    for d in domains:  # a domain's accuracy is the share of its tokens its own expert's slot took; none for expert 2's
        want = [sum(conf[domains.index(d), s] for s, e in enumerate(home) if home[e] == d)]
        assert np.isclose(np.mean(ra_sub["accuracy"][d]), want[0])
    assert np.mean(ra_sub["accuracy"][ra_full["expert_domain"][2]]) == 0
    assert min(np.mean(ra_sub["accuracy"][home[e]]) for e in home) > 0.5  # each slot takes its own domain's tokens


def test_eval_stops_before_training_when_a_split_is_shorter_than_a_window(trained_run, tmp_path):
    """A domain whose test or validation text cannot fill one perplexity window is refused at once, in one line,
    before any baseline trains (eval used to stop there only when it came to score, after training)."""
    out = tmp_path / "ev"
    r = CliRunner().invoke(app, ["eval", str(trained_run), "--out", str(out), "--ctx", "100000000"])
    assert r.exit_code == 1
    assert "fewer than one perplexity window of 100000000" in r.output and "pass --ctx" in r.output
    assert "Traceback" not in r.output
    assert not (out / "models").exists()  # nothing assembled, nothing trained
