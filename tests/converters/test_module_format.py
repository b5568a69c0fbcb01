"""Module format 2: experts hold weights and means, one pooled second moment per trunk, blake3 digests. A module
of format 1 (mfgguf before 0.2: a second moment in every expert, sha256 only) is refused in one line."""

from __future__ import annotations

import json
import os
import shutil

import gguf
import numpy as np
import pytest
from typer.testing import CliRunner

from mfgguf.cli.app import app
from mfgguf.converters.assemble import assemble
from mfgguf.run import STATS_PREFIX, RunDir

from . import synthetic_run


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    return synthetic_run(tmp_path_factory.mktemp("formats") / "run", preset="tiny", n_experts=3, vocab=400, seed=0)


def test_experts_hold_no_second_moment_and_record_blake3(run):
    rd = RunDir(run)
    for i in (1, 2, 3):
        m = json.loads(rd.module_meta(i).read_text())
        assert m["version"] == 2 and m["blake3"]
        assert not [k for k in m["tensors"] if "second_moment" in k]
    pooled = json.loads(rd.router_stats_meta.read_text())
    assert pooled["trunk_sha256"] == json.loads(rd.module_meta(0).read_text())["sha256"]
    assert json.loads(rd.manifest.read_text())["router_stats"]["blake3"] == pooled["blake3"]


@pytest.mark.parametrize("index,fix", [(3, "mfgguf train-expert RUN --expert 3 --restart"),
                                       (0, "mfgguf train-trunk RUN --restart")])
def test_a_module_of_format_1_is_refused_in_one_line(run, tmp_path, index, fix):
    old = shutil.copytree(run, tmp_path / "run")
    rd = RunDir(old)
    meta = json.loads(rd.module_meta(index).read_text())
    meta["version"] = 1
    meta.pop("blake3")
    rd.module_meta(index).write_text(json.dumps(meta))
    r = CliRunner().invoke(app, ["assemble", str(old), "-o", str(tmp_path / "m.gguf"), "-q"])
    name = "trunk" if index == 0 else f"expert_{index:03d}"
    assert r.exit_code == 1 and "Traceback" not in r.output, r.output
    assert r.output.strip() == f"error: {name} was written in module format 1 (mfgguf before 0.2); retrain it with `{fix}`"
    assert not os.path.exists(tmp_path / "m.gguf")


def test_centroid_and_uniform_need_no_pooled_file(run, tmp_path):
    run = shutil.copytree(run, tmp_path / "run")
    RunDir(run).router_stats_meta.unlink()
    RunDir(run).router_stats.unlink()
    for router in ("centroid", "uniform"):
        assert assemble(run, tmp_path / f"{router}.gguf", router=router, progress=False)["router"] == router


def test_pooled_file_holds_only_second_moments(run):
    from safetensors import safe_open

    with safe_open(str(RunDir(run).router_stats), "numpy") as f:
        keys = list(f.keys())
    assert keys and all(k.startswith(STATS_PREFIX) and k.endswith(".second_moment") for k in keys)


def test_fast_quant_writes_the_same_model_up_to_rounding(run, tmp_path):
    """`assemble --fast-quant`: same tensors and types, q8_0 quants differing from the reference's by one step in a
    few places per million, and llama.cpp's logits as close to the reference file's as q8_0 rounding allows."""
    from tokenizers import Tokenizer

    from mfgguf.converters import fastquant

    from . import llama_logits, rel_diff, text_sample

    if not fastquant.available():
        pytest.skip("libggml-cpu not loadable")
    ref = assemble(run, tmp_path / "ref.gguf", quant="q8_0", progress=False)
    fast = assemble(run, tmp_path / "fast.gguf", quant="q8_0", fast_quant=True, progress=False)
    assert fast["quantizer"].startswith("ggml-cpu") and ref["quantizer"] == "ggml"
    a, b = gguf.GGUFReader(ref["path"]).tensors, gguf.GGUFReader(fast["path"]).tensors
    assert [(t.name, t.tensor_type) for t in a] == [(t.name, t.tensor_type) for t in b]
    differ = sum(int(np.count_nonzero(np.asarray(x.data) != np.asarray(y.data))) for x, y in zip(a, b))
    assert differ <= 1e-4 * sum(int(np.asarray(x.data).nbytes) for x in a)
    ids = Tokenizer.from_file(str(RunDir(run).tokenizer)).encode(text_sample()).ids[:32]
    assert rel_diff(llama_logits(tmp_path / "fast.gguf", ids, 32), llama_logits(tmp_path / "ref.gguf", ids, 32)) < 1e-2
