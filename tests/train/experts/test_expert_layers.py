"""`--expert-layers`: the expert trains in the chosen layers only, keeps its start elsewhere, and the
backward pass stops at the lowest layer that trains."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

from mfgguf.cli.app import app
from mfgguf.config import ModelConfig, expert_layers
from mfgguf.errors import MfggufError
from mfgguf.flops import expert_step_flops, module_step_flops
from mfgguf.options import TrainOptions
from mfgguf.run import RunDir
from mfgguf.train.engine.driver import get_batch
from mfgguf.train.experts.expert import build_expert_model, expert_params, freeze_expert_layers, train_expert
from mfgguf.train.engine.loop import forward_loss, load_tokens
from tests.conftest import copy_run


def test_layer_specs():
    assert expert_layers("all", 4) == (0, 1, 2, 3) and expert_layers("upper", 30) == tuple(range(15, 30))
    assert expert_layers("lower", 5) == (0, 1) and expert_layers(" 3, 0-1,1 ", 4) == (0, 1, 3)
    for bad in ("", "upper-half", "3-9", "-1", "2-1"):
        with pytest.raises(MfggufError, match="names no layers of this trunk's 0-3"):
            expert_layers(bad, 4)


def test_backward_stops_at_the_lowest_trained_layer(trained_run):
    rd = RunDir(trained_run)
    cfg = ModelConfig.from_dict(json.loads(rd.module_meta(0).read_text())["config"])
    x, y = get_batch(load_tokens(rd.shard(1), "shard"), 0, 1, 0, 2, cfg.ctx_len)
    # activation gradients run through a layer's attention only when an expert below it trains
    for layers, reached in (((0, 1), {1}), ((1,), set())):
        model = build_expert_model(rd, cfg, seed=0, dev=torch.device("cpu"), bf16_trunk=False)
        freeze_expert_layers(model, layers)
        assert set(expert_params(model)) == {f"layers.{l}.experts.0.{p}.weight" for l in layers for p in ("gate", "up", "down")}
        seen = set()
        for l, layer in enumerate(model.layers):  # a backward hook fires only where autograd computes a gradient
            layer.attn_q.register_full_backward_hook(lambda m, gi, go, l=l: seen.add(l))
        forward_loss(model, x, y, "single", recompute=True).backward()
        assert seen == reached


def test_upper_layers_expert(trained_run, tmp_path):
    run = copy_run(trained_run, tmp_path / "run")
    rd = RunDir(run)
    before = load_file(rd.module_file(1))
    meta = train_expert(run, 1, options=TrainOptions(tokens=4_096, expert_layers="1"), progress=False)
    t = load_file(rd.module_file(1))
    assert not t["blk.0.ffn_down.weight"].any()  # layer 0 kept its start: a zero down-projection, a no-op
    assert t["blk.1.ffn_down.weight"].abs().max() > 0 and not torch.equal(t["blk.1.ffn_gate.weight"], before["blk.1.ffn_gate.weight"])
    assert meta["train"]["expert_layers"] == "1"
    # its steps owe less: no expert weight gradients in layer 0, no activation gradients below layer 1's FFN
    cfg = ModelConfig.from_dict(meta["config"])
    assert module_step_flops(meta).total < expert_step_flops(cfg).total == module_step_flops({**meta, "train": {}}).total


def test_bad_layers_and_complement_are_one_clear_line(trained_run, tmp_path):
    run = copy_run(trained_run, tmp_path / "run")
    r = CliRunner().invoke(app, ["train-expert", str(run), "--expert", "1", "--tokens", "2048", "--expert-layers", "5-9",
                                 "--no-progress"])
    assert r.exit_code == 1 and "names no layers of this trunk's 0-1" in r.output and "Traceback" not in r.output
    with pytest.raises(MfggufError, match="--complement trains a two-way MoE in every layer"):
        train_expert(run, 1, options=TrainOptions(tokens=2_048, expert_layers="upper", complement=True), progress=False)

