"""Module format 2 (weights + means; one pooled second moment per trunk) against format 1 (a second moment in
every expert): the same model from the same statistics, old runs still assemble, damage in either is caught."""

from __future__ import annotations

import json
import os

import gguf
import numpy as np
import pytest
from typer.testing import CliRunner

from mfgguf.cli.app import app
from mfgguf.converters.assemble import assemble
from mfgguf.run import STATS_PREFIX, RunDir

from . import flip_byte, synthetic_run


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The same random modules (seed 0) written in both formats."""
    d = tmp_path_factory.mktemp("formats")
    kw = dict(preset="tiny", n_experts=3, vocab=400, seed=0)
    return synthetic_run(d / "v2", **kw), synthetic_run(d / "v1", format1=True, **kw)


def _tensors(path):
    return {t.name: np.array(t.data) for t in gguf.GGUFReader(path).tensors}


def test_format2_experts_hold_no_second_moment_and_are_smaller(runs):
    v2, v1 = (RunDir(r) for r in runs)
    for i in (1, 2, 3):
        m2, m1 = (json.loads(rd.module_meta(i).read_text()) for rd in (v2, v1))
        assert m2["version"] == 2 and m2["blake3"] and m1["version"] == 1 and "blake3" not in m1
        assert v2.module_file(i).stat().st_size < v1.module_file(i).stat().st_size
    pooled = json.loads(v2.router_stats_meta.read_text())
    assert pooled["trunk_sha256"] == json.loads(v2.module_meta(0).read_text())["sha256"]
    man = json.loads(v2.manifest.read_text())
    assert man["router_stats"]["blake3"] == pooled["blake3"]
    assert not v1.router_stats.exists()


@pytest.mark.parametrize("layout", ["granitemoe", "mixtral"])
def test_old_runs_assemble_to_the_same_model(runs, tmp_path, layout):
    """A format-1 run (old experts, sha256 only) still assembles; weights are the same bytes and the
    router, from the pooled moment instead of the per-expert ones, the same to float rounding."""
    out = {}
    for name, run in zip(("v2", "v1"), runs):
        r = assemble(run, tmp_path / f"{name}.gguf", quant="q8_0", layout=layout, top_k=2, progress=False)
        out[name] = _tensors(r["path"])
    a, b = out["v2"], out["v1"]
    assert a.keys() == b.keys()
    for k in a:
        if k.endswith("ffn_gate_inp.weight"):
            np.testing.assert_allclose(a[k], b[k], rtol=1e-3, atol=1e-4)
        else:
            assert np.array_equal(a[k], b[k]), k


def test_damaged_old_module_is_caught_by_its_sha256(runs, tmp_path):
    import shutil

    run = shutil.copytree(runs[1], tmp_path / "run")
    flip_byte(RunDir(run).module_file(3))
    r = CliRunner().invoke(app, ["assemble", str(run), "-o", str(tmp_path / "m.gguf"), "-q"])
    assert r.exit_code == 1 and "expert_003" in r.output and "recorded sha256" in r.output, r.output
    assert not os.path.exists(tmp_path / "m.gguf")


def test_centroid_and_uniform_need_no_pooled_file(runs, tmp_path):
    import shutil

    run = shutil.copytree(runs[0], tmp_path / "run")
    RunDir(run).router_stats_meta.unlink()
    RunDir(run).router_stats.unlink()
    for router in ("centroid", "uniform"):
        assert assemble(run, tmp_path / f"{router}.gguf", router=router, progress=False)["router"] == router


def test_pooled_file_holds_only_second_moments(runs):
    from safetensors import safe_open

    with safe_open(str(RunDir(runs[0]).router_stats), "numpy") as f:
        keys = list(f.keys())
    assert keys and all(k.startswith(STATS_PREFIX) and k.endswith(".second_moment") for k in keys)


def test_fast_quant_writes_the_same_model_up_to_rounding(runs, tmp_path):
    """`assemble --fast-quant`: same tensors and types, q8_0 quants differing from the reference's by one step in a
    few places per million, and llama.cpp's logits as close to the reference file's as q8_0 rounding allows."""
    from tokenizers import Tokenizer

    from mfgguf.converters import fastquant

    from . import llama_logits, rel_diff, text_sample

    if not fastquant.available():
        pytest.skip("libggml-cpu not loadable")
    ref = assemble(runs[0], tmp_path / "ref.gguf", quant="q8_0", progress=False)
    fast = assemble(runs[0], tmp_path / "fast.gguf", quant="q8_0", fast_quant=True, progress=False)
    assert fast["quantizer"].startswith("ggml-cpu") and ref["quantizer"] == "ggml"
    a, b = gguf.GGUFReader(ref["path"]).tensors, gguf.GGUFReader(fast["path"]).tensors
    assert [(t.name, t.tensor_type) for t in a] == [(t.name, t.tensor_type) for t in b]
    differ = sum(int(np.count_nonzero(np.asarray(x.data) != np.asarray(y.data))) for x, y in zip(a, b))
    assert differ <= 1e-4 * sum(int(np.asarray(x.data).nbytes) for x in a)
    ids = Tokenizer.from_file(str(RunDir(runs[0]).tokenizer)).encode(text_sample()).ids[:32]
    assert rel_diff(llama_logits(tmp_path / "fast.gguf", ids, 32), llama_logits(tmp_path / "ref.gguf", ids, 32)) < 1e-2
