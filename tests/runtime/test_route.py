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
