"""Trunk training on the real tiny pipeline: metadata, held-out losses, the saved weights, overrides."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from mfgguf.config import ModelConfig
from mfgguf.errors import MfggufError
from mfgguf.model import Transformer, trunk_shapes
from mfgguf.options import TrainOptions
from mfgguf.run import RunDir, read_manifest, sha256_file
from mfgguf.train.engine.loop import evaluate
from mfgguf.train.whole.trunk import train_trunk
from tests.conftest import copy_run


def test_trunk_module_and_metadata(trained_run):
    rd = RunDir(trained_run)
    meta = json.loads(rd.module_meta(0).read_text())
    info = rd.info()
    assert meta["kind"] == "trunk" and meta["preset"] == "tiny" and meta["partition"] == "label"
    assert meta["config"]["vocab_size"] == info["vocab_size"] and meta["config"]["n_experts"] == info["n_experts"]
    assert meta["train"]["tokens"] == 40_000 and meta["tokens_seen"] == meta["steps"] * 8 * 64
    assert set(meta["validation_loss"]) == set(info["domains"])
    assert all(math.isfinite(v) for v in meta["validation_loss"].values())
    assert meta["validation_loss_mean"] == pytest.approx(np.mean(list(meta["validation_loss"].values())))
    # It learned: the smoothed final loss is well below the first step's (~ln 512 = 6.2).
    assert meta["history"][0][2] > 5.5 and meta["final_loss"] < meta["history"][0][2] - 0.7
    assert meta["sha256"] == sha256_file(rd.module_file(0)) == read_manifest(rd)["modules"]["trunk"]["sha256"]
    assert (rd.plots / "loss_trunk.png").stat().st_size > 1000
    assert not rd.checkpoint_dir(0).exists()  # removed once the module is written


def test_saved_trunk_reproduces_its_validation_loss(trained_run):
    rd = RunDir(trained_run)
    meta = json.loads(rd.module_meta(0).read_text())
    cfg = ModelConfig.from_dict(meta["config"])
    tensors = load_file(rd.module_file(0))
    assert {k: tuple(v.shape) for k, v in tensors.items()} == trunk_shapes(cfg)
    model = Transformer(cfg)
    model.load_trunk(tensors)
    dom = sorted(meta["validation_loss"])[0]
    toks = np.load(rd.validation_dir / f"{dom}.npy", allow_pickle=False)  # the split the trunk records its loss on
    loss, n = evaluate(model, toks, meta["train"]["eval_tokens"], "anchor", torch.device("cpu"), meta["precision"])
    assert n > 0 and loss == pytest.approx(meta["validation_loss"][dom], abs=1e-4)


def test_fp32_and_dense_baseline_override(prepared_run, tmp_path):
    run = copy_run(prepared_run, tmp_path / "run")
    meta = train_trunk(run, preset="tiny", options=TrainOptions(tokens=2048, anchor_ff=256, eval_tokens=256),
                       precision="fp32", progress=False)
    assert meta["precision"] == "fp32" and meta["config"]["anchor_ff"] == 256
    assert meta["tensors"]["blk.0.ffn_up_shexp.weight"] == [256, 64]
    assert meta["steps"] == 4 and meta["train"]["eval_tokens"] == 256
    if not torch.cuda.is_available():  # on a GPU machine this error path does not exist
        with pytest.raises(MfggufError, match="no CUDA GPU.*--device cpu"):
            train_trunk(run, preset="tiny", device="cuda", progress=False)
