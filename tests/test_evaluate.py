"""`mfgguf eval` on the tiny trained run: every model really assembled and measured by llama.cpp."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from mfgguf.cli.app import app


def test_eval_report(trained_run, tmp_path):
    out = tmp_path / "eval"
    r = CliRunner().invoke(app, ["eval", str(trained_run), "--out", str(out), "--routers", "ridge,uniform",
                                 "--top-k", "1,2", "--max-tokens", "2048"])
    assert r.exit_code == 0, r.output
    rep = json.loads((out / "report.json").read_text())
    res = rep["results"]
    domains = rep["domains"]
    for name in ("moe ridge top-1", "moe ridge top-2", "moe uniform top-1", "trunk alone", "dense (compute-matched)"):
        assert name in res, name
        assert set(res[name]["domains"]) == set(domains)
        assert res[name]["peak_rss_mb"] > 10 and res[name]["decode_tps"] > 0
    for d in domains:
        assert set(res[f"oracle {d}"]["domains"]) == {d}
    # The dense baseline is compute-matched: it saw as many tokens as the trunk and experts together.
    dense_meta = json.loads((out / "dense-run" / "modules" / "trunk.json").read_text())
    trunk_meta = json.loads((trained_run / "modules" / "trunk.json").read_text())
    assert dense_meta["config"]["anchor_ff"] == trunk_meta["config"]["anchor_ff"] + trunk_meta["config"]["expert_ff"]
    # Quantized copies of the best MoE stay close to f16 even on a tiny model.
    assert abs(rep["goals"]["q8_0_over_f16"] - 1) < 0.02
    # Routing accuracy per layer is a share in [0, 1] for every domain.
    acc = rep["routing"]["ridge"]["accuracy"]
    assert set(acc) == set(domains) and all(0 <= a <= 1 for v in acc.values() for a in v)
    md = (out / "report.md").read_text()
    assert "| trunk alone |" in md and "oracle routing" in md and "## Goals" in md
    for png in ("ppl_by_domain.png", "routing_confusion.png"):
        assert (out / png).read_bytes()[:4] == b"\x89PNG"


def test_eval_needs_a_run(tmp_path):
    r = CliRunner().invoke(app, ["eval", str(tmp_path)])
    assert r.exit_code == 1 and r.output.startswith("error:") and "Traceback" not in r.output
