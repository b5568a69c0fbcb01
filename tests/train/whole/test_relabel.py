"""`mfgguf relabel` on the session's really trained tiny run: documents move, none is lost or made up, the new
RUN trains and its refusals are one line."""

from __future__ import annotations

import json
from collections import Counter

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from mfgguf.cli.app import app
from mfgguf.config import ModelConfig
from mfgguf.data.relabel import documents
from mfgguf.run import RunDir, sha256_file
from mfgguf.train.experts.expert import build_expert_model, load_trunk_meta, train_expert
from mfgguf.train.whole.relabel import prefix_losses
from mfgguf.train.engine.weights import read_safetensors

from tests.conftest import copy_run


def _docs(rd: RunDir, i: int, eos: int) -> list[bytes]:
    t = np.load(rd.shard(i))
    return [t[s:e].tobytes() for s, e in documents(t, eos)]


@pytest.fixture(scope="module")
def relabelled(trained_run, tmp_path_factory):
    out = tmp_path_factory.mktemp("relabel") / "run-em"
    res = CliRunner().invoke(app, ["relabel", str(trained_run), "-o", str(out), "--prefix", "32", "--no-progress"])
    assert res.exit_code == 0 and "documents" in res.output and "shard 1:" in res.output, res.output
    return trained_run, out, json.loads(RunDir(out).run_json.read_text())


def test_every_document_lands_in_exactly_one_new_shard(relabelled):
    run, out, info = relabelled
    src, dst = RunDir(run), RunDir(out)
    eos, n = int(info["eos_id"]), int(info["n_experts"])
    old = Counter(d for i in range(1, n + 1) for d in _docs(src, i, eos))
    new = Counter(d for i in range(1, n + 1) for d in _docs(dst, i, eos))
    assert old == new
    r = info["relabel"]
    assert r["docs"] == sum(old.values()) and r["prefix"] == 32 and r["experts"] == list(range(1, n + 1))
    assert r["scored_tokens"] == n * sum(min(len(d) // np.load(src.shard(1)).itemsize, 33) * k for d, k in old.items())
    assert r["forward_flops"] > 0 and r["forward_flops"] % r["scored_tokens"] == 0
    assert 0 < r["moved_docs"] < r["docs"]  # tiny experts disagree with the labels on some documents, not all
    assert r["prefix_loss_after"] < r["prefix_loss_before"]  # each moved document went to a lower loss
    total = sum(s["tokens"] for s in info["shards"])
    assert all(s["tokens"] <= 1.5 * total / n + max(len(d) for d in new) for s in info["shards"])  # the cap
    moved_in = {s["id"]: sum(s["relabelled_from"].values()) for s in info["shards"]}
    assert moved_in == {s["id"]: s["tokens"] for s in info["shards"]}
    assert json.loads((dst.run_json).read_text())["relabel"] == r


def test_the_new_run_shares_trunk_mix_and_heldout_and_holds_no_experts(relabelled):
    run, out, _ = relabelled
    src, dst = RunDir(run), RunDir(out)
    assert sha256_file(dst.module_file(0)) == sha256_file(src.module_file(0))
    assert sha256_file(dst.train_tokens) == sha256_file(src.train_tokens)
    assert sorted(p.name for p in dst.heldout_dir.iterdir()) == sorted(p.name for p in src.heldout_dir.iterdir())
    assert not dst.module_file(1).exists() and list(json.loads(dst.manifest.read_text())["modules"]) == ["trunk"]


def test_prefix_loss_is_the_models_own_loss(trained_run):
    rd = RunDir(trained_run)
    trunk = load_trunk_meta(rd)
    cfg = ModelConfig.from_dict(trunk["config"])
    model = build_expert_model(rd, cfg, 0, torch.device("cpu"), bf16_trunk=False)
    model.load_expert({k: t for k, t in read_safetensors(rd.module_file(2)) if k.startswith("blk.")})
    t = np.load(rd.shard(2))
    spans = [(2, s, e) for s, e in documents(t, int(rd.info()["eos_id"]))[:5]]
    got = prefix_losses(model, {2: t}, spans, 16, torch.device("cpu"), "fp32")
    for (_, s, e), g in zip(spans, got):
        w = torch.from_numpy(t[s : min(e, s + 17)].astype(np.int64))[None]
        with torch.no_grad():
            ref = model(w[:, :-1], w[:, 1:], route="single").item()
        assert g == pytest.approx(ref, rel=1e-5)


def test_the_relabelled_run_trains_an_expert(relabelled, tmp_path):
    _, out, _ = relabelled
    run = copy_run(out, tmp_path / "run")
    from mfgguf.options import TrainOptions

    meta = train_expert(run, 1, options=TrainOptions(tokens=2048, eval_tokens=256), progress=False)
    assert meta["shard_domains"] and np.isfinite(meta["heldout_loss_mean"])


def test_cli_refusals_are_one_line(trained_run, tmp_path):
    r = CliRunner()
    cases = [
        ([str(trained_run), "-o", str(trained_run)], "RUN itself"),
        ([str(trained_run), "-o", str(tmp_path), "--experts", "1"], "at least two"),
        ([str(trained_run), "-o", str(tmp_path / "x"), "--cap", "0.5"], "--cap"),
        ([str(trained_run), "-o", str(tmp_path)], "already exists"),
    ]
    for args, msg in cases:
        res = r.invoke(app, ["relabel", *args, "--no-progress"])
        assert res.exit_code == 1 and msg in res.output and "Traceback" not in res.output, (args, res.output)
        assert len(res.output.strip().splitlines()) == 1
    untrained = copy_run(trained_run, tmp_path / "untrained")
    RunDir(untrained).module_file(3).unlink()
    RunDir(untrained).module_meta(3).unlink()
    res = r.invoke(app, ["relabel", str(untrained), "-o", str(tmp_path / "y"), "--no-progress"])
    assert res.exit_code == 1 and "expert_003 is not trained yet" in res.output
    assert not (tmp_path / "y").exists()


def test_tokens_draws_a_part_of_each_shard_and_only_that(trained_run, tmp_path):
    from mfgguf.train.whole.relabel import relabel

    info = relabel(trained_run, tmp_path / "em", experts=[1, 2], prefix=16, tokens=3000, progress=False)
    src, dst = RunDir(trained_run), RunDir(tmp_path / "em")
    eos = int(info["eos_id"])
    old = {i: Counter(_docs(src, i, eos)) for i in (1, 2)}
    new = Counter(d for i in (1, 2) for d in _docs(dst, i, eos))
    for i in (1, 2):
        drawn = {d: n for d, n in new.items() if d in old[i]}
        size = sum((len(d) // np.load(src.shard(i)).itemsize + 1) * n for d, n in drawn.items())
        assert 3000 <= size < 3000 + max(len(d) for d in old[i]) and len(drawn) < len(old[i])
    assert sum(new.values()) == info["relabel"]["docs"]
    assert sha256_file(dst.shard(3)) == sha256_file(src.shard(3))  # not selected: carried over unchanged


def test_keep_labels_is_the_same_draw_unmoved(trained_run, tmp_path):
    from mfgguf.train.whole.relabel import relabel

    a = relabel(trained_run, tmp_path / "em", experts=[1, 2], prefix=16, tokens=3000, progress=False)
    b = relabel(trained_run, tmp_path / "ctl", experts=[1, 2], tokens=3000, keep_labels=True, progress=False)
    eos = int(a["eos_id"])
    drawn = lambda p: Counter(d for i in (1, 2) for d in _docs(RunDir(p), i, eos))  # noqa: E731
    assert drawn(tmp_path / "em") == drawn(tmp_path / "ctl")
    assert b["relabel"]["moved_docs"] == 0 and b["relabel"]["prefix_loss_before"] is None
    src = RunDir(trained_run)
    for i in (1, 2):
        assert set(_docs(RunDir(tmp_path / "ctl"), i, eos)) <= set(_docs(src, i, eos))
