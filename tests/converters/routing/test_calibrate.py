"""Calibration on training tokens: what it writes, what llama.cpp then runs, and that the held-out split stays unread."""

from __future__ import annotations

import json
import math
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from mfgguf.cli.app import app
from mfgguf.converters.assemble import assemble
from mfgguf.converters.routing.calibrate import CALIBRATION_KEY, CalibrationGrid, calibrate, routers, training_sample
from mfgguf.gguf.edit import copy_with_kv, read_f32, read_kv, set_scalar
from mfgguf.run import RunDir
from mfgguf.runtime.perplexity import perplexity

from tests.conftest import copy_run
from tests.converters import llama_logits

CTX = 32
GRID = CalibrationGrid(top_k=(1, 2), temperature=(0.5, 1.0))


_OPENED: list[str] | None = None


def _audit(event, args):  # records every path Python opens while a test sets _OPENED to a list
    if _OPENED is not None and event == "open" and args:
        _OPENED.append(str(args[0]))


sys.addaudithook(_audit)


def test_calibration_never_reads_the_test_split_and_writes_what_llama_runs(f32_moe, tmp_path):
    global _OPENED
    run, gguf = f32_moe
    run = copy_run(run, tmp_path / "run")
    test = RunDir(run).test_dir
    assert any(test.glob("*.npy"))
    away = tmp_path / "test-moved-away"
    shutil.move(test, away)  # not there at all: calibration cannot need it
    out = tmp_path / "cal.gguf"
    _OPENED = []
    try:
        r = calibrate(gguf, run, out, grid=GRID, tokens=4 * CTX, ctx=CTX, threads=2, progress=False)
    finally:
        opened, _OPENED = _OPENED, None
    assert any(p.endswith("train.npy") for p in opened)  # the hook sees the files calibration reads
    assert not [p for p in opened if Path(p).is_relative_to(test) or Path(p).is_relative_to(away)], opened
    assert not test.exists() and any(away.glob("*.npy"))

    # every candidate was scored, the settings the file had among them; the best one was chosen
    c = r["chosen"]
    assert len(r["candidates"]) == 1 + 2  # top-1 as built, top-2 at two temperatures
    assert r["ppl_before"] == next(x["ppl"] for x in r["candidates"] if x["top_k"] == 1)
    assert min(x["ppl"] for x in r["candidates"]) == pytest.approx(r["ppl_after"], rel=1e-9)
    assert r["ppl_after"] <= r["ppl_before"]

    # the file holds the settings: top-k as expert_used_count, temperature in the router
    kv = read_kv(out)
    assert kv["granitemoe.expert_used_count"] == kv["mfgguf.top_k"] == c["top_k"]
    rec = json.loads(kv[CALIBRATION_KEY])
    assert (rec["top_k"], rec["temperature"]) == (c["top_k"], c["temperature"])
    assert rec["sample"] == "data/train.npy" and rec["tokens"] == 4 * CTX
    names = [f"blk.{l}.ffn_gate_inp.weight" for l in range(2)]
    R0, R1 = read_f32(gguf, names), read_f32(out, names)
    want = routers(R0, c["temperature"])
    for n in names:
        np.testing.assert_array_equal(R1[n], want[n])

    # llama.cpp runs the calibrated file to the figure recorded, with no side file
    sample = training_sample(RunDir(run), 4 * CTX, CTX)
    assert math.exp(perplexity(out, sample, ctx=CTX)["nll"]) == pytest.approx(rec["ppl_after"], rel=1e-6)
    assert math.exp(perplexity(gguf, sample, ctx=CTX)["nll"]) == pytest.approx(rec["ppl_before"], rel=1e-6)


def test_temperature_folds_into_the_router(f32_moe, tmp_path):
    """R / t at top-2 changes llama.cpp's output; at top-1 (selected weight renormalised to 1) it does not."""
    run, gguf = f32_moe
    names = [f"blk.{l}.ffn_gate_inp.weight" for l in range(2)]
    R = read_f32(gguf, names)
    ids = training_sample(RunDir(run), CTX, CTX).tolist()
    from mfgguf.gguf.edit import set_f32

    def logits(k, t):
        p = tmp_path / f"k{k}t{t}.gguf"
        copy_with_kv(gguf, p, [])
        set_scalar(p, "granitemoe.expert_used_count", k)
        set_f32(p, routers(R, t))
        return llama_logits(p, ids, CTX)

    np.testing.assert_array_equal(logits(1, 0.5), logits(1, 1.0))
    assert np.abs(logits(2, 0.5) - logits(2, 1.0)).max() > 1e-3


def test_copy_is_byte_identical_and_weight_keys_are_ignored_by_granitemoe(f32_moe, tmp_path):
    """Why `expert_weights_scale`/`_norm`/`expert_gating_func` are not calibrated: llama.cpp's granitemoe ignores them."""
    _, gguf = f32_moe
    same = tmp_path / "same.gguf"
    copy_with_kv(gguf, same, [])
    assert same.read_bytes() == gguf.read_bytes()
    ids = list(range(1, CTX + 1))
    base = tmp_path / "k2.gguf"
    copy_with_kv(gguf, base, [])
    set_scalar(base, "granitemoe.expert_used_count", 2)
    ref = llama_logits(base, ids, CTX)
    for key, vt, v in (("expert_weights_scale", "FLOAT32", 3.0), ("expert_weights_norm", "BOOL", False),
                       ("expert_gating_func", "UINT32", 2)):
        p = tmp_path / f"{key}.gguf"
        copy_with_kv(base, p, [(f"granitemoe.{key}", vt, v)])
        assert read_kv(p)[f"granitemoe.{key}"] == v
        np.testing.assert_array_equal(llama_logits(p, ids, CTX), ref)


def _cli(*args):
    r = CliRunner().invoke(app, ["calibrate", *map(str, args)])
    return r.exit_code, r.output


def test_cli_bad_input_is_one_line_and_writes_nothing(f32_moe, tmp_path):
    run, gguf = f32_moe
    out = tmp_path / "cal.gguf"
    code, text = _cli(gguf, "--run", tmp_path / "nope", "-o", out)
    assert code == 1 and text.count("\n") == 1 and "RUN directory not found" in text and "Traceback" not in text
    assert not out.exists()
    out.write_bytes(b"user work")
    code, text = _cli(gguf, "--run", run, "-o", out)
    assert code == 1 and text.count("\n") == 1 and "--force" in text
    assert out.read_bytes() == b"user work"
    code, text = _cli(gguf, "--run", run, "-o", tmp_path / "x.gguf", "--top-k", "5")
    assert code == 1 and text.count("\n") == 1 and "out of range" in text
    code, text = _cli(gguf, "--run", run, "-o", tmp_path / "x.gguf", "--temperature", "hot")
    assert code == 1 and text.count("\n") == 1 and "comma-separated" in text
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cal.gguf"]  # no scratch or temporary file left


def test_cli_calibrates(f32_moe, tmp_path):
    run, gguf = f32_moe
    out = tmp_path / "cal.gguf"
    code, text = _cli(gguf, "--run", run, "-o", out, "--top-k", "1,2", "--temperature", "1",
                      "--tokens", 2 * CTX, "--ctx", CTX, "--threads", 2, "--quiet")
    assert code == 0, text
    assert f"wrote {out}: top-" in text and "ppl" in text
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cal.gguf"]
    rec = json.loads(read_kv(out)[CALIBRATION_KEY])
    assert rec["top_k"] in (1, 2) and "bias" not in rec


def test_mixtral_layout_and_dense_model(f32_moe, tmp_path):
    """The llama-arch (mixtral) layout calibrates the same way; a dense file is refused in one line."""
    run, _ = f32_moe
    mix, dense = tmp_path / "mix.gguf", tmp_path / "dense.gguf"
    assemble(run, mix, quant="f32", layout="folded", progress=False)
    r = calibrate(mix, run, tmp_path / "mix-cal.gguf", grid=CalibrationGrid(top_k=(2,), temperature=(1.0,)),
                  tokens=2 * CTX, ctx=CTX, threads=2, progress=False)
    kv = read_kv(tmp_path / "mix-cal.gguf")
    assert kv["general.architecture"] == "llama" and kv["llama.expert_used_count"] == r["chosen"]["top_k"]
    assert {x["top_k"] for x in r["candidates"]} == {1, 2}
    assemble(run, dense, quant="f32", experts=[], progress=False)
    code, text = _cli(dense, "--run", run, "-o", tmp_path / "x.gguf")
    assert code == 1 and text.count("\n") == 1 and "Mixture-of-Experts" in text
    assert not (tmp_path / "x.gguf").exists()


def test_extend_drops_the_record_with_the_rows_it_recomputes(f32_moe, tmp_path):
    from mfgguf.converters.extend import extend

    run, gguf = f32_moe
    cal = tmp_path / "cal.gguf"
    calibrate(gguf, run, cal, grid=CalibrationGrid(top_k=(1,), temperature=(1.0,)), tokens=2 * CTX,
              ctx=CTX, threads=2, progress=False)
    assert CALIBRATION_KEY in read_kv(cal)
    extend(cal, tmp_path / "two.gguf", remove=[3])  # every row recomputed for the two left: the record is stale
    extend(cal, tmp_path / "kept.gguf", remove=[3], keep_routing=True)  # the two keep their calibrated rows
    assert CALIBRATION_KEY not in read_kv(tmp_path / "two.gguf")
    assert read_kv(tmp_path / "kept.gguf")[CALIBRATION_KEY] == read_kv(cal)[CALIBRATION_KEY]
    names = [f"blk.{l}.ffn_gate_inp.weight" for l in range(2)]
    kept, before = read_f32(tmp_path / "kept.gguf", names), read_f32(cal, names)
    for n in names:
        np.testing.assert_array_equal(kept[n], before[n][:2])
