"""Experts a token chosen at run time: llama.cpp's metadata override gives what a file with that count written in it
gives (what `calibrate` writes), in the runtime, in `generate`, and in both benchmark engines; the banner says it."""

from __future__ import annotations

import numpy as np
import pytest
from typer.testing import CliRunner

from mfgguf.cli.app import app
from mfgguf.gguf.edit import copy_with_kv
from mfgguf.runtime.chat import banner
from mfgguf.runtime.llm import loaded
from tests.converters import text_sample
from tests.runtime.choice.files import write_hellaswag


def _logits(path, ids, **kw) -> np.ndarray:
    with loaded(path, n_ctx=64, logits_all=True, **kw) as llm:
        llm.reset()
        llm.eval(ids)
        return np.array(llm.scores[: len(ids)], dtype=np.float32)


@pytest.fixture(scope="module")
def written(tiny_gguf, tmp_path_factory):
    """{k: the tiny top-1 MoE with expert_used_count k written into a copy}, as calibrate writes it."""
    d = tmp_path_factory.mktemp("k")
    out = {}
    for k in (2, 3):
        out[k] = d / f"k{k}.gguf"
        copy_with_kv(tiny_gguf, out[k], [("granitemoe.expert_used_count", "UINT32", k)])
    return out


def test_k_at_run_time_gives_the_logits_of_the_file_with_k_written(tiny_gguf, written):
    with loaded(tiny_gguf, n_ctx=64) as llm:
        ids = llm.tokenize(text_sample(600).encode(), add_bos=False)[:48]
    one = _logits(tiny_gguf, ids)
    for k, f in written.items():
        run_time = _logits(tiny_gguf, ids, experts_per_token=k)
        assert np.array_equal(run_time, _logits(f, ids)), k
        assert not np.array_equal(run_time, one)  # more experts a token did change the model


def test_generate_and_the_banner_take_the_count(tiny_gguf, written):
    args = ["generate", str(tiny_gguf), "The value", "--max-tokens", "12", "--temperature", "0"]
    a = CliRunner().invoke(app, [*args, "--experts-per-token", "2"])
    b = CliRunner().invoke(app, ["generate", str(written[2]), *args[2:]])
    assert a.exit_code == b.exit_code == 0 and a.stdout == b.stdout
    with loaded(tiny_gguf, n_ctx=64, experts_per_token=3) as llm:
        assert "; 3 a token)" in banner(llm.mfgguf_header, tiny_gguf, 64)
    r = CliRunner().invoke(app, [*args, "--experts-per-token", "4"])
    assert r.exit_code == 1 and "--experts-per-token 4 is out of range" in r.stderr


@pytest.mark.parametrize("engine", ["llama-perplexity", "llama-cpp-python"])
def test_benchmarks_take_the_count_in_both_engines(tiny_gguf, written, tmp_path, engine):
    from mfgguf.runtime.choice.benchmark import benchmark

    if engine == "llama-perplexity":
        from tests.runtime.llama_tools import tool

        tool("llama-perplexity")
    data = write_hellaswag(tmp_path / "hs.txt")
    a = benchmark(tiny_gguf, "hellaswag", data, ctx=128, threads=2, engine=engine, experts_per_token=2)
    b = benchmark(written[2], "hellaswag", data, ctx=128, threads=2, engine="llama-cpp-python")
    assert a["right"] == b["right"] and a["experts_per_token"] == 2
