"""Which experts answered, read from llama.cpp's graph, against the PyTorch reference's routing of the same file."""

from __future__ import annotations

import json

import numpy as np
from typer.testing import CliRunner

from mfgguf.cli.app import app
from mfgguf.reference import reference_routes
from mfgguf.runtime.route import routes, summary
from tests.converters import text_sample


def test_llama_cpps_routing_is_the_references_on_nearly_every_token_layer(f32_moe):
    """f32 weights: llama.cpp's top-1 expert equals the reference's on at least 99% of token-layers, and where the
    two agree, so do the weights; the summary's shares add up."""
    from mfgguf.runtime.llm import loaded

    run, gguf = f32_moe
    with loaded(gguf, n_ctx=64) as llm:
        ids = llm.tokenize(text_sample(4000).encode(), add_bos=False)
    agree, close = [], []
    for w in range(0, 12 * 64, 64):  # windows of the tiny preset's trained context
        r = routes(gguf, ids=ids[w: w + 64])
        slots, weights = reference_routes(run, gguf, r.ids)
        assert slots.shape == r.slots.shape == (64, 2, 1)
        a = (slots == r.slots).all(axis=-1)  # (T, L)
        agree.append(a)
        close.append(np.abs(weights[a] - r.weights[a]).max())
    agree = np.concatenate(agree)
    print(f"agreement {agree.mean():.4f} over {agree.size} token-layers")
    assert agree.mean() >= 0.99 and max(close) < 1e-3
    s = summary(r)
    assert abs(sum(v["top1"] for v in s["experts"].values()) - 1) < 1e-9 and set(s["experts"]) == set(r.labels)


def test_route_verb_prints_the_experts_writes_json_and_a_heat_map(tiny_gguf, tmp_path):
    text = tmp_path / "t.txt"
    text.write_text(text_sample(400))
    png = tmp_path / "r.png"
    res = CliRunner().invoke(app, ["route", str(tiny_gguf), "--file", str(text), "--png", str(png), "--json",
                                   "--experts-per-token", "2"])
    assert res.exit_code == 0, res.output
    j = json.loads(res.stdout)
    assert j["experts_per_token"] == 2 and len(j["slots"]) == len(j["tokens"]) and j["labels"] == ["c", "english", "python"]
    assert png.stat().st_size > 0
    res = CliRunner().invoke(app, ["route", str(tiny_gguf), "for x in items:"])
    assert res.exit_code == 0 and "share of token-layers" in res.stdout and "python" in res.stdout
    res = CliRunner().invoke(app, ["route", str(tiny_gguf)])
    assert res.exit_code == 1 and "nothing to route" in res.stderr


def test_generate_show_experts_prints_the_table_on_stderr_and_only_text_on_stdout(tiny_gguf):
    res = CliRunner().invoke(app, ["generate", str(tiny_gguf), "for x in", "--max-tokens", "8", "--temperature", "0",
                                   "--show-experts"])
    assert res.exit_code == 0, res.output
    assert "share of token-layers" in res.stderr and "share of token-layers" not in res.stdout
    plain = CliRunner().invoke(app, ["generate", str(tiny_gguf), "for x in", "--max-tokens", "8", "--temperature", "0"])
    assert plain.stdout == res.stdout


def test_top_two_routing_and_weights_are_the_references(f32_moe, tmp_path):
    """At top-2 the set of experts chosen and their weights (granitemoe: the probabilities as they are) agree too."""
    from mfgguf.converters.assemble import assemble
    from mfgguf.runtime.llm import loaded

    run, _ = f32_moe
    top2 = tmp_path / "top2.gguf"
    assemble(run, top2, quant="f32", top_k=2, progress=False)
    with loaded(top2, n_ctx=64) as llm:
        ids = llm.tokenize(text_sample(2000).encode(), add_bos=False)
    agree = []
    for w in range(0, 4 * 64, 64):
        r = routes(top2, ids=ids[w: w + 64])
        slots, weights = reference_routes(run, top2, r.ids)
        order_a, order_b = np.argsort(r.slots, -1), np.argsort(slots, -1)
        same = (np.take_along_axis(r.slots, order_a, -1) == np.take_along_axis(slots, order_b, -1)).all(-1)
        agree.append(same)
        wa = np.take_along_axis(r.weights, order_a, -1)[same]
        wb = np.take_along_axis(weights, order_b, -1)[same]
        assert np.abs(wa - wb).max() < 1e-3
    assert np.concatenate(agree).mean() >= 0.99
