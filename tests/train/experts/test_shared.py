"""Experts that also train shared parameters (`train-expert --shared`): private f32 copies of trunk
tensors, everything else frozen, the copies in the module file, and a real own-domain gain."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

from mfgguf.cli.app import app
from mfgguf.config import ModelConfig, get_preset, shared_tensor_names
from mfgguf.run import SHARED_PREFIX, STATS_PREFIX, RunDir, sha256_file
from mfgguf.train.experts.expert import build_expert_model, expert_params, train_expert
from mfgguf.options import TrainOptions
from mfgguf.train.engine.loop import load_tokens, make_optimizer, run_loop
from mfgguf.train.engine.records import Checkpoints, Drive, StepSetup
from mfgguf.train.experts.shared import lr_scales, shared_names, shared_params
from mfgguf.train.experts.tailstats import moments_path
from tests.conftest import copy_run
from tests.train.experts.test_expert import two_training_steps


def _cfg(rd: RunDir) -> ModelConfig:
    return ModelConfig.from_dict(json.loads(rd.module_meta(0).read_text())["config"])


@pytest.fixture(scope="module")
def attn_run(trained_run, tmp_path_factory):
    """trained_run with expert 1 retrained with --shared attn, same tokens and seed as trained_run's."""
    run = copy_run(trained_run, tmp_path_factory.mktemp("shared") / "run")
    train_expert(run, 1, options=TrainOptions(shared="attn"), progress=False)
    return run


def test_shared_none_writes_the_same_bytes(trained_run, tmp_path):
    """--shared none is today's expert: the fixture's file (trained with defaults) byte for byte."""
    run = copy_run(trained_run, tmp_path / "run")
    rd = RunDir(run)
    r = CliRunner().invoke(app, ["train-expert", str(run), "--expert", "1", "--shared", "none", "--no-progress"])
    assert r.exit_code == 0, r.output
    assert sha256_file(rd.module_file(1)) == sha256_file(RunDir(trained_run).module_file(1))
    meta = json.loads(rd.module_meta(1).read_text())
    assert meta["shared"] == "none" and meta["shared_tensors"] == []
    assert not [k for k in load_file(rd.module_file(1)) if k.startswith(SHARED_PREFIX)]


def test_shared_attn_module_file_and_own_domain_gain(attn_run, trained_run):
    rd, base = RunDir(attn_run), RunDir(trained_run)
    cfg = _cfg(rd)
    names = shared_tensor_names(cfg, "attn")
    meta = json.loads(rd.module_meta(1).read_text())
    none = json.loads(base.module_meta(1).read_text())
    assert meta["shared"] == "attn" and meta["shared_tensors"] == names
    assert meta["tokens_seen"] == none["tokens_seen"] and meta["train"]["seed"] == none["train"]["seed"]
    t, trunk = load_file(rd.module_file(1)), load_file(rd.module_file(0))
    assert sorted(k for k in t if k.startswith(SHARED_PREFIX)) == sorted(SHARED_PREFIX + n for n in names)
    for n in names:
        copy = t[SHARED_PREFIX + n]
        assert copy.dtype == torch.float32 and copy.shape == trunk[n].shape, n
        assert not torch.equal(copy, trunk[n]), f"{n} did not train"
        assert meta["tensors"][SHARED_PREFIX + n] == list(trunk[n].shape)
    # the FFN and the router statistics are still there, unchanged in form
    ffn = {f"blk.{l}.ffn_{w}.weight" for l in range(cfg.n_layers) for w in ("gate", "up", "down")}
    assert {k for k in t if not k.startswith((SHARED_PREFIX, STATS_PREFIX))} == ffn
    # Router statistics come from the expert's own model: after ITS ffn_norm copy w, |mean / w|^2 <= dim.
    for l in range(cfg.n_layers):
        mu, w = t[f"{STATS_PREFIX}blk.{l}.mean"], t[f"{SHARED_PREFIX}blk.{l}.ffn_norm.weight"]
        assert f"{STATS_PREFIX}blk.{l}.second_moment" not in t
        assert 0 < ((mu / w) ** 2).sum().item() <= cfg.dim * 1.01
    # One round: the copy trained the whole schedule apart, so the final sync measures its statistics again
    # rather than take the ones of its steps (sync-rounds.md): no second moments are gathered for it.
    assert not moments_path(rd, 1).exists()  # nor an FFN-only expert's from before
    # Training attention too buys more on the expert's own domain than the FFN alone, at the same tokens.
    (own,) = meta["shard_domains"]
    assert meta["validation_loss"][own] < none["validation_loss"][own] - 0.01, (meta["validation_loss"], none["validation_loss"])


def test_only_the_expert_and_its_shared_copies_train(trained_run):
    rd = RunDir(trained_run)
    cfg = _cfg(rd)
    model = build_expert_model(rd, cfg, seed=0, dev=torch.device("cpu"), bf16_trunk=True,
                               trainable=shared_names(cfg, "attn"))
    shared = shared_params(model, "attn")
    assert len(shared) == len(shared_tensor_names(cfg, "attn")) == 6 * cfg.n_layers + 1
    named = {**expert_params(model), **shared}
    opt = make_optimizer(named, get_preset("tiny").expert, {n: 0.5 for n in shared})
    scaled = {id(p) for g in opt.param_groups if g["lr_scale"] == 0.5 for p in g["params"]}
    assert scaled == {id(p) for p in shared.values()}
    opt_params = two_training_steps(model, opt, rd, cfg)
    for name, p in model.named_parameters():
        if name in named:
            assert p.requires_grad and p.grad is not None and p.grad.abs().sum() > 0, name
            assert id(p) in opt_params and p in opt.state and p.dtype == torch.float32, name
        else:  # embedding, output head, anchor FFN, router: frozen, no gradient, no optimizer state
            assert not p.requires_grad and p.grad is None and id(p) not in opt_params and p not in opt.state, name


def test_shared_lr_scale_scales_the_copies_updates(trained_run, tmp_path):
    """run_loop applies the schedule times each group's scale: a tiny scale leaves the copies ~still."""
    rd = RunDir(trained_run)
    cfg = _cfg(rd)
    trunk = load_file(rd.module_file(0))
    moved = {}
    for scale in (1.0, 1e-6):
        tc = replace(get_preset("tiny").expert, tokens=3 * 8 * cfg.ctx_len, shared="norms", shared_lr_scale=scale)
        model = build_expert_model(rd, cfg, seed=0, dev=torch.device("cpu"), bf16_trunk=False,
                                   trainable=shared_names(cfg, "norms"))
        named = {**expert_params(model), **shared_params(model, "norms")}
        run_loop(model, named, load_tokens(rd.shard(1), "shard"), tc,
                 setup=StepSetup(torch.device("cpu"), "fp32", "single", lr_scale=lr_scales(model, tc)),
                 ckpt=Checkpoints(tmp_path / str(scale), {}), drive=Drive(stream=1, progress=False))
        moved[scale] = max((model.get_parameter(n) - trunk[g]).abs().max().item() for n, g in shared_names(cfg, "norms").items())
    assert moved[1.0] > 1e-4 and moved[1e-6] < 1e-6, moved


@pytest.mark.parametrize("args, match", [(["--shared", "attention"], "unknown --shared 'attention'"),
                                         (["--shared", "attn", "--shared-lr-scale", "0"], "--shared-lr-scale")])
def test_bad_shared_options_fail_cleanly(trained_run, tmp_path, args, match):
    run = copy_run(trained_run, tmp_path / "run")
    before = {str(p.relative_to(run)): sha256_file(p) for p in sorted(run.rglob("*")) if p.is_file()}
    r = CliRunner().invoke(app, ["train-expert", str(run), "--expert", "1", *args])
    assert r.exit_code == 1, (r.exit_code, r.output)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and match in lines[0], r.stderr
    assert "Traceback" not in r.output
    assert {str(p.relative_to(run)): sha256_file(p) for p in sorted(run.rglob("*")) if p.is_file()} == before
