"""The loss mask in training: ignored targets leave every loss and its gradient, the mean is over the counted ones,
nothing counted is 0 (not NaN), the mask's windows are the token windows', and a real expert step on a chat RUN
trains on the assistant turns (tests/data/chat_base.py)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from typer.testing import CliRunner

from mfgguf.cli.app import app
from mfgguf.data.masks import counted_share, load_mask, mask_path, mask_targets, target_mask
from mfgguf.head_loss import IGNORE_INDEX, head_cross_entropy
from mfgguf.train.engine.driver import get_batch
from tests.data.chat_base import build_chat_run

runner = CliRunner()


def _case(N=300, C=16, V=50, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(N, C, generator=g)
    w = torch.randn(V, C, generator=g)
    y = torch.randint(0, V, (N,), generator=g)
    return x, w, y


@pytest.mark.parametrize("trains_head", [False, True])
def test_ignored_targets_leave_the_loss_and_its_gradient(trains_head, monkeypatch):
    import mfgguf.head_loss as hl

    monkeypatch.setattr(hl, "LOGITS_CHUNK", 50 * 64)  # several chunks of the chunked (frozen head) path
    x, w, y = _case()
    keep = torch.rand(len(y), generator=torch.Generator().manual_seed(1)) < 0.3
    ym = y.masked_fill(~keep, IGNORE_INDEX)
    xa = x.clone().requires_grad_()
    w.requires_grad_(trains_head)
    got = head_cross_entropy(xa, w, ym)
    got.backward()
    xb = x[keep].clone().requires_grad_()  # the reference: the counted positions alone
    want = F.cross_entropy(F.linear(xb, w.detach()), y[keep])
    want.backward()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(xa.grad[keep], xb.grad, rtol=1e-5, atol=1e-7)
    assert float(xa.grad[~keep].abs().max()) == 0.0


@pytest.mark.parametrize("grad", ["chunked", "head trains", "no_grad"])
def test_a_batch_with_nothing_counted_is_zero_not_nan(grad):
    x, w, y = _case(N=40)
    y = torch.full_like(y, IGNORE_INDEX)
    x.requires_grad_(grad != "no_grad")
    w.requires_grad_(grad == "head trains")
    with torch.set_grad_enabled(grad != "no_grad"):
        loss = head_cross_entropy(x, w, y)
    assert float(loss.detach()) == 0.0
    if grad != "no_grad":
        loss.backward()
        assert torch.isfinite(x.grad).all() and float(x.grad.abs().max()) == 0.0


def test_the_mask_windows_are_the_token_windows():
    """get_batch run on the mask draws the same starts as on the tokens (what the driver relies on), and
    target_mask cut at given starts agrees with it."""
    tokens = np.arange(5000, dtype=np.uint16)
    mask = (tokens % 3 != 0).astype(np.uint8)  # a mask readable from the token itself
    x, y = get_batch(tokens, 7, 2, 11, 4, 32)
    my = mask_targets(y, get_batch(mask, 7, 2, 11, 4, 32)[1])
    assert torch.equal(my == IGNORE_INDEX, y % 3 == 0) and torch.equal(my[my != IGNORE_INDEX], y[y % 3 != 0])
    starts = (x[:, 0]).numpy()  # tokens[s] == s
    assert torch.equal(target_mask(mask, starts, 32), y % 3 != 0)


def test_a_micro_batch_weighs_its_share_of_the_counted_targets():
    y = torch.arange(12).reshape(4, 3)
    assert counted_share(y[:2], y) == 0.5  # nothing masked: its rows' share, exactly as before masks
    y[0] = IGNORE_INDEX
    y[1, 0] = IGNORE_INDEX
    assert counted_share(y[:2], y) == 2 / 8 and counted_share(y[2:], y) == 6 / 8
    assert counted_share(y[:1], torch.full_like(y, IGNORE_INDEX)) == 0.0


def test_evaluate_scores_the_counted_targets_only():
    from dataclasses import replace

    from mfgguf.config import get_preset
    from mfgguf.model import Transformer
    from mfgguf.train.engine.loop import evaluate

    cfg = replace(get_preset("tiny").model, vocab_size=64, ctx_len=16)
    torch.manual_seed(0)
    model = Transformer(cfg)
    tokens = np.random.default_rng(0).integers(0, 64, 200).astype(np.uint16)
    mask = np.zeros(200, np.uint8)
    mask[50:90] = 1
    loss, n = evaluate(model, tokens, 10_000, "anchor", torch.device("cpu"), "fp32", mask=mask)
    whole, n_all = evaluate(model, tokens, 10_000, "anchor", torch.device("cpu"), "fp32")
    assert n == 40 and n_all == 192 and loss != whole
    with torch.no_grad():  # by hand: the same windows, the counted targets' mean
        w = torch.from_numpy(tokens[:193].astype(np.int64)).reshape(-1)
        logits = torch.cat([model(w[s: s + 16][None])[0] for s in range(0, 192, 16)])
        nll = F.cross_entropy(logits, w[1:193], reduction="none")
    assert math.isclose(loss, float(nll[49:89].mean()), rel_tol=1e-5)
    none, n_none = evaluate(model, tokens, 10_000, "anchor", torch.device("cpu"), "fp32", mask=np.zeros(200, np.uint8))
    assert n_none == 0 and math.isnan(none)


def test_an_expert_trains_on_a_chat_runs_assistant_turns(tmp_path):
    """One real expert training on the conversations' shard: finite, and not the loss the same steps give
    with every token counted (the mask file removed); the validation loss is the assistant turns'."""
    run = build_chat_run(tmp_path)
    info = json.loads((run / "run.json").read_text())
    i = next(s["id"] for s in info["shards"] if "chat" in s["domains"])
    args = ["train-expert", run, "--expert", str(i), "--tokens", "512", "--batch-size", "4", "--eval-tokens", "512",
            "--no-progress"]

    def trained() -> dict:
        r = runner.invoke(app, [str(a) for a in args])
        assert r.exit_code == 0, r.output
        return json.loads((run / "modules" / f"expert_{i:03d}.json").read_text())

    masked = trained()
    mask_path(run / "data" / f"shard_{i:03d}.npy").rename(tmp_path / "kept.mask")  # every token counts now
    args.append("--restart")
    plain = trained()
    assert math.isfinite(masked["final_loss"]) and math.isfinite(plain["final_loss"])
    assert masked["final_loss"] != plain["final_loss"]
    # the validation loss is on the assistant turns in both: the split's mask is still there
    assert load_mask(run / "data" / "valid" / "chat.npy") is not None
    assert set(masked["validation_loss"]) == {"chat", "prose"}


def test_streamed_training_is_the_in_memory_training_under_a_mask(prepared_run, tmp_path):
    """The layer-streamed head leaves the same targets out as the in-memory one: a random half of the trunk's
    training targets and of the validation targets masked, the same losses and validation losses either way
    (tests/train/engine/test_streamed.py compares the two unmasked)."""
    from dataclasses import replace

    from mfgguf.options import TrainOptions
    from mfgguf.run import RunDir
    from mfgguf.train.whole.trunk import train_trunk
    from tests.conftest import copy_run

    runs = []
    for name in ("mem", "stream"):
        rd = RunDir(copy_run(prepared_run, tmp_path / name))
        rng = np.random.default_rng(0)
        for f in [rd.train_tokens, *sorted(rd.validation_dir.glob("*.npy"))]:
            with open(mask_path(f), "wb") as out:
                np.save(out, (rng.random(len(np.load(f, mmap_mode="r"))) < 0.5).astype(np.uint8))
        runs.append(rd.root)
    opts = replace(TrainOptions(tokens=8 * 64 * 3, adam_eps=1e-6), eval_every=3)
    ma = train_trunk(runs[0], preset="tiny", progress=False, options=opts, precision="fp32")
    mb = train_trunk(runs[1], preset="tiny", progress=False, options=opts, precision="fp32", stream=True, accum=1)
    np.testing.assert_allclose([h[2] for h in mb["history"]], [h[2] for h in ma["history"]], rtol=1e-5)
    np.testing.assert_allclose(list(mb["validation_loss"].values()), list(ma["validation_loss"].values()), rtol=1e-5)
    assert all(math.isfinite(h[2]) for h in ma["history"])
