"""Layer-streamed trunk training (`train-trunk --stream / --memory-budget`): the same training as in
memory, in bounded memory, resumable after SIGKILL at any step."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

from mfgguf.cli.app import app
from mfgguf.errors import MfggufError
from mfgguf.options import TrainOptions
from mfgguf.run import RunDir, file_digests, write_module, write_module_streamed
from mfgguf.train.whole.trunk import parse_size, train_trunk
from tests.conftest import copy_run

REPO = Path(__file__).parents[3]


def _pair(prepared_run, tmp_path, mem: dict, streamed: dict, options: TrainOptions, **kw):
    a, b = copy_run(prepared_run, tmp_path / "mem"), copy_run(prepared_run, tmp_path / "stream")
    common = dict(progress=False, options=replace(options, eval_every=3), **kw)
    return a, b, train_trunk(a, **common, **mem), train_trunk(b, stream=True, **common, **streamed)


@pytest.mark.parametrize("case, mem, streamed, tol", [
    ("tiny", {}, {"accum": 1}, 1e-5),
    ("tiny-seed", {}, {"accum": 1}, 1e-5),  # with the seed FFN
    ("tiny-accum", {"accum": 2}, {"accum": 2}, 1e-5),  # two micro-batches of 8 in every block
    ("small", {}, {"accum": 1}, 1e-4),
], ids=lambda v: v if isinstance(v, str) else "")
def test_streamed_training_is_the_in_memory_training(prepared_run, tmp_path, case, mem, streamed, tol):
    """Same losses, same curves, same weights in fp32, on every CPU.

    The two paths sum in different orders (a chunked head, micro-batches, another embedding
    backward), so gradients differ by rounding, about 1e-10 absolute. AdamW turns that into an
    update difference of up to lr * |dg| / eps for an element whose gradient is near eps (it moves
    that element by g / (|g| + eps) of lr): with the default eps 1e-8, one cancelling embedding
    element differed by 2.4e-5 on an AVX2-only CPU (7.7e-7 with AVX-512). eps = 1e-6 bounds the
    amplification at lr * 1e-10 / 1e-6 = 3e-7 per step, so `tol` holds with margin on both, while a
    wrong update still fails it (an LR 0.1% off moves every element about 3e-6 per step)."""
    preset = "small" if case == "small" else "tiny"
    tokens = 16 * 256 * 3 if preset == "small" else 8 * 64 * 6
    a, b, ma, mb = _pair(prepared_run, tmp_path, {"precision": "fp32", **mem}, {"precision": "fp32", **streamed},
                         preset=preset, options=TrainOptions(tokens=tokens, adam_eps=1e-6, seed_expert=case == "tiny-seed" or None))
    assert len(ma["history"]) == len(mb["history"]) >= 3
    np.testing.assert_allclose([h[2] for h in mb["history"]], [h[2] for h in ma["history"]], rtol=1e-5)
    assert [h[:2] for h in mb["validation_history"]] == [h[:2] for h in ma["validation_history"]]
    for (_, _, da), (_, _, db) in zip(ma["validation_history"], mb["validation_history"]):
        np.testing.assert_allclose(list(db.values()), list(da.values()), rtol=1e-5)
    np.testing.assert_allclose(list(mb["validation_loss"].values()), list(ma["validation_loss"].values()), rtol=1e-5)
    ta, tb = load_file(RunDir(a).module_file(0)), load_file(RunDir(b).module_file(0))
    assert ta.keys() == tb.keys()
    for k in ta:
        torch.testing.assert_close(tb[k], ta[k], atol=tol, rtol=0, msg=k)
    s = mb["streamed"]
    if case == "tiny-accum":
        assert s["micro_batch"] == 8 and mb["train"]["batch_size"] == 16
    assert s["read_bytes_per_step"] > s["disk_bytes"] / 7 and s["written_bytes_per_step"] > 0
    assert not RunDir(b).checkpoint_dir(0).exists()  # the streamed state is gone once the module is written


def test_streamed_bf16_tracks_in_memory(prepared_run, tmp_path):
    """Under bf16 autocast (this machine's default precision where it has native bf16) the two differ
    only by rounding: the head's vocabulary chunks add the log-sum-exp in another order."""
    _, _, ma, mb = _pair(prepared_run, tmp_path, {}, {"accum": 1}, preset="tiny",
                         options=TrainOptions(tokens=8 * 64 * 6))
    np.testing.assert_allclose([h[2] for h in mb["history"]], [h[2] for h in ma["history"]], rtol=1e-3)
    assert abs(mb["validation_loss_mean"] - ma["validation_loss_mean"]) < 1e-3


def test_sigkill_then_resume_streamed_is_bit_identical(prepared_run, tmp_path):
    a, b = copy_run(prepared_run, tmp_path / "a"), copy_run(prepared_run, tmp_path / "b")
    tokens = 8 * 64 * 40
    cmd = [sys.executable, "-c", "from mfgguf.cli.app import main; main()", "train-trunk", str(a), "--preset", "tiny",
           "--tokens", str(tokens), "--stream", "--accum", "1", "--eval-every", "4", "--no-progress"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, cwd=REPO,
                            env={**os.environ, "PYTHONPATH": str(REPO)})
    state = RunDir(a).checkpoint_dir(0) / "stream" / "state.json"
    deadline = time.monotonic() + 120
    try:
        while not (state.is_file() and json.loads(state.read_text())["step"] >= 5):
            assert proc.poll() is None, f"training exited before step 5: {proc.stderr.read()!r}"
            assert time.monotonic() < deadline, "no step 5 within 120 s"
            time.sleep(0.002)
        os.kill(proc.pid, signal.SIGKILL)  # mid-step: the other state set is half written
    finally:
        assert proc.wait() == -signal.SIGKILL
    assert not RunDir(a).module_file(0).exists()

    opts = TrainOptions(tokens=tokens, eval_every=4)
    with pytest.raises(MfggufError, match="layer-streamed checkpoint.*--stream"):
        train_trunk(a, preset="tiny", options=opts, stream=False, progress=False)
    # no --stream needed: the checkpoint says how this run trains
    resumed = train_trunk(a, preset="tiny", options=opts, accum=1, progress=False)
    whole = train_trunk(b, preset="tiny", options=opts, stream=True, accum=1, progress=False)
    assert resumed["resumed_from_step"] >= 5 and whole["resumed_from_step"] == 0
    assert resumed["history"] == whole["history"]
    assert resumed["validation_history"] == whole["validation_history"]
    assert file_digests(RunDir(a).module_file(0)) == file_digests(RunDir(b).module_file(0))


def test_streamed_module_file_is_write_modules_file(tmp_path):
    """Golden bytes: the hand-built safetensors of a streamed trunk equals safetensors' own."""
    rng = np.random.default_rng(0)
    tensors = {"token_embd.weight": rng.standard_normal((7, 4), dtype=np.float32),
               "blk.0.attn_norm.weight": rng.standard_normal(4, dtype=np.float32),
               "output.weight": rng.standard_normal((7, 4), dtype=np.float32)}
    a, b = RunDir(tmp_path / "a"), RunDir(tmp_path / "b")
    ma = write_module(a, 0, tensors, {"kind": "trunk"})
    mb = write_module_streamed(b, 0, {k: v.shape for k, v in tensors.items()}, tensors.__getitem__, {"kind": "trunk"})
    assert a.module_file(0).read_bytes() == b.module_file(0).read_bytes()
    assert ma == mb


@pytest.mark.parametrize("text, n", [("1.5G", 3 << 29), ("800M", 800 << 20), ("2GiB", 2 << 30), ("123", 123)])
def test_parse_size(text, n):
    assert parse_size(text) == n


@pytest.mark.parametrize("args, message", [
    (["--memory-budget", "lots"], "--memory-budget 'lots' is not a size; write it like 1.5G"),
    (["--stream", "--memory-budget", "100M"], "needs about"),
    (["--accum", "0"], "--accum 0 must be at least 1"),
])
def test_cli_rejects_bad_memory_options(prepared_run, tmp_path, args, message):
    run = copy_run(prepared_run, tmp_path / "run")
    r = CliRunner().invoke(app, ["train-trunk", str(run), "--preset", "tiny", "--tokens", "2048", "--no-progress", *args])
    assert r.exit_code == 1, r.output
    assert message in r.output and "Traceback" not in r.output
    assert len(r.output.strip().splitlines()) == 1
    assert not RunDir(run).module_file(0).exists()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: streams RAM -> device there")
def test_streamed_on_cuda_matches_cpu(prepared_run, tmp_path):
    a, b = copy_run(prepared_run, tmp_path / "cpu"), copy_run(prepared_run, tmp_path / "cuda")
    kw = dict(preset="tiny", options=TrainOptions(tokens=8 * 64 * 4), stream=True, accum=1, precision="fp32", progress=False)
    ma, mb = train_trunk(a, **kw), train_trunk(b, device="cuda", **kw)
    np.testing.assert_allclose([h[2] for h in mb["history"]], [h[2] for h in ma["history"]], rtol=1e-3)


def test_spilled_activations_change_nothing(prepared_run, tmp_path):
    """Block inputs kept in a scratch file (large accumulated batches) give the same steps as in RAM."""
    from dataclasses import replace

    from mfgguf.config import get_preset
    from mfgguf.train.engine.driver import get_batch
    from mfgguf.train.engine.loop import load_tokens, resolve_device
    from mfgguf.train.engine.offload import ParamStore, trunk_units
    from mfgguf.train.engine.streamed import StreamedTrunk
    from mfgguf.train.engine.streamed_loop import init_from_seed

    p = get_preset("tiny")
    cfg = replace(p.model, vocab_size=512)
    data = load_tokens(RunDir(prepared_run).train_tokens, "tokens")
    losses, weights = [], []
    for spill in (False, True):
        store = ParamStore(tmp_path / f"spill{spill}", trunk_units(cfg))
        store.create(init_from_seed(cfg, 0))
        trunk = StreamedTrunk(cfg, "anchor", store, resolve_device("cpu"), "fp32", micro=4, spill=spill)
        losses.append([])
        for s in range(3):
            losses[-1].append(trunk.step(*get_batch(data, 0, 0, s, 8, cfg.ctx_len), s, 1e-3, p.trunk))
            trunk.update()  # overlaps the next step's forward
        trunk.join()
        weights.append(store.read("blk.1", trunk.set, "P"))
        assert (tmp_path / f"spill{spill}" / "acts.tmp.bin").exists() == spill
        store.close()
    assert losses[0] == losses[1]
    np.testing.assert_array_equal(weights[0], weights[1])
