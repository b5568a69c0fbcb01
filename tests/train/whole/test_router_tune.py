"""Router-only tuning: the straight-through gate, what the tuned file holds, and what the CLI refuses."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from mfgguf.cli.app import app
from mfgguf.converters.assemble import assemble
from mfgguf.gguf.edit import read_f32, read_kv
from mfgguf.reference import reference_model
from mfgguf.run import RunDir
from mfgguf.runtime.perplexity import perplexity
from mfgguf.train.whole.router_tune import TUNING_KEY, RouterTuning, sample_windows, tune_router

from tests.conftest import copy_run

TUNE = RouterTuning(tokens=2048, epochs=2, lr=1e-2, batch_size=4, ctx=32, val_tokens=512, val_ctx=64)


def test_straight_through_gate_same_forward_and_a_router_gradient_under_top1(f32_moe):
    run, gguf = f32_moe
    net, route = reference_model(run, gguf)
    assert net.cfg.top_k == 1
    idx = torch.from_numpy(np.load(RunDir(run).shard(1))[:33].astype(np.int64))[None]  # (1, 33)
    grads = {}
    for st in (False, True):
        for layer in net.layers:
            layer.straight_through_gates = st
            layer.router.requires_grad_(True)
            layer.router.grad = None
        loss = net(idx[:, :-1], idx[:, 1:], route=route)
        loss.backward()
        grads[st] = (loss.item(), torch.stack([layer.router.grad for layer in net.layers]))  # (L, N, dim)
    assert grads[True][0] == grads[False][0]  # the forward is the file's, bit for bit
    # renormalised top-1: the weight is w / w = 1, so only rounding (~1e-12) reaches the router
    assert grads[False][1].norm() < 1e-6 * grads[True][1].norm()
    assert grads[True][1].norm() > 1e-4


def test_tuned_file_differs_in_router_rows_only_and_never_reads_the_test_split(f32_moe, tmp_path):
    run, gguf = f32_moe
    run = copy_run(run, tmp_path / "run")
    test = RunDir(run).test_dir
    away = tmp_path / "test-away"
    shutil.move(test, away)  # not there: tuning cannot need it
    out = tmp_path / "tuned.gguf"
    r = tune_router(gguf, run, out, tuning=TUNE, threads=2, progress=False)
    assert not test.exists()

    names = [f"blk.{l}.ffn_gate_inp.weight" for l in range(2)]
    before, after = read_f32(gguf, names), read_f32(out, names)
    rec = json.loads(read_kv(out)[TUNING_KEY])
    assert rec["kept"] == r["kept"] and rec["steps"] == r["steps"] == 2 * (2048 // 32 // 4)
    assert rec["sample"] == [f"data/shard_{i:03d}.npy" for i in (1, 2, 3)]
    moved = any(not np.array_equal(before[n], after[n]) for n in names)
    assert moved == r["kept"]  # tuned rows written exactly when they helped
    assert r["ppl_after"] <= r["ppl_before"]
    # the written file scores what the record says on the validation sample
    val = sample_windows(RunDir(run), [1, 2, 3], 2048, 32, 512, 64, 0).val
    assert perplexity(out, val, ctx=64, threads=2)["ppl"] == pytest.approx(r["ppl_after"], rel=1e-6)
    # everything else is the original file, byte for byte, apart from the router tensors and the record
    kv0, kv1 = read_kv(gguf), read_kv(out)
    assert {k: v for k, v in kv1.items() if k != TUNING_KEY} == kv0
    import gguf as g

    a, b = g.GGUFReader(gguf), g.GGUFReader(out)
    for ta, tb in zip(a.tensors, b.tensors):
        assert ta.name == tb.name
        if "ffn_gate_inp" not in ta.name:
            assert np.array_equal(np.asarray(ta.data), np.asarray(tb.data)), ta.name


def test_the_loss_falls_on_the_tuning_windows(f32_moe, tmp_path):
    run, gguf = f32_moe
    # one step an epoch over all 16 windows: history[k] is the objective itself before the k-th update
    t = RouterTuning(tokens=512, epochs=8, lr=1e-2, batch_size=16, micro_batch=4, ctx=32, val_tokens=256, val_ctx=64)
    h = tune_router(gguf, run, tmp_path / "t.gguf", tuning=t, threads=2, progress=False)["history"]
    assert len(h) == 8 and h[-1] < h[0] - 1e-3, h


def test_cli_refuses_in_one_line(f32_moe, tmp_path):
    run, gguf = f32_moe
    cli = CliRunner()
    out = tmp_path / "x.gguf"
    out.write_bytes(b"user's file")
    r = cli.invoke(app, ["tune-router", str(gguf), "--run", str(run), "-o", str(out), "--no-progress"])
    assert r.exit_code == 1 and "already exists" in r.output and len(r.output.strip().splitlines()) == 1
    assert out.read_bytes() == b"user's file"
    r = cli.invoke(app, ["tune-router", str(gguf), "--run", str(run), "-o", str(gguf), "--no-progress"])
    assert r.exit_code == 1 and "--force" in r.output
    dense = tmp_path / "dense.gguf"
    assemble(run, dense, experts=[], quant="f32", progress=False)
    r = cli.invoke(app, ["tune-router", str(dense), "--run", str(run), "-o", str(tmp_path / "y.gguf"), "--no-progress"])
    assert r.exit_code == 1 and "2+ experts" in r.output and "Traceback" not in r.output
    other = copy_run(run, tmp_path / "other")
    meta = RunDir(other).module_meta(2)
    m = json.loads(meta.read_text())
    m["sha256"] = "0" * 64
    meta.write_text(json.dumps(m))
    r = cli.invoke(app, ["tune-router", str(gguf), "--run", str(other), "-o", str(tmp_path / "z.gguf"), "--no-progress"])
    assert r.exit_code == 1 and "expert 2" in r.output and "not the one" in r.output
    assert not (tmp_path / "z.gguf").exists() and not (tmp_path / "y.gguf").exists()


def test_cli_writes_and_reports(f32_moe, tmp_path):
    run, gguf = f32_moe
    out = tmp_path / "tuned.gguf"
    r = CliRunner().invoke(app, ["tune-router", str(gguf), "--run", str(run), "-o", str(out), "--tokens", "1024",
                                 "--epochs", "1", "--ctx", "32", "--val-tokens", "256", "--no-progress", "--json"])
    assert r.exit_code == 0, r.output
    d = json.loads(r.output)
    assert d["path"] == str(out) and out.is_file() and d["tokens"] == 1024 and "history" not in d


def test_a_conversation_shard_tunes_and_scores_only_its_counted_targets(tmp_path):
    """A shard with a loss mask (a conversation's context turns at 0) gives each tuning window its targets' mask
    and the validation tokens theirs; a shard without one counts every token."""
    data = tmp_path / "data"
    data.mkdir()
    rng = np.random.default_rng(0)
    for i in (1, 2):
        np.save(data / f"shard_{i:03d}.npy", rng.integers(0, 100, 2000).astype(np.uint16))
    mask = (np.arange(2000) % 3 != 0).astype(np.uint8)  # (T,) every third token context only
    np.save(data / "shard_001.mask", mask)
    (data / "shard_001.mask.npy").rename(data / "shard_001.mask")
    s = sample_windows(RunDir(tmp_path), [1, 2], 640, 32, 256, 64, 0)
    shard = {i: np.load(data / f"shard_{i:03d}.npy") for i in (1, 2)}
    assert s.counted is not None and s.counted.shape == (len(s.windows), 32) and s.val_mask.shape == s.val.shape
    for w, c in zip(s.windows, s.counted):
        own = 1 if any(np.array_equal(w, shard[1][a:a + 33]) for a in range(2000 - 32)) else 2
        if own == 2:
            assert c.all()
        else:
            a = next(a for a in range(2000 - 32) if np.array_equal(w, shard[1][a:a + 33]))
            assert np.array_equal(c, mask[a + 1:a + 33])
    assert 0 < s.val_mask.sum() < len(s.val_mask)
