"""A trunk with a seed FFN (`train-trunk --seed-expert`): experts start from it (BTX upcycling).

Real tiny training on the built-in corpus: the trunk trains anchor + seed as one dense model, its
trunk-alone GGUF is that dense model (llama.cpp == PyTorch), an expert's step 0 is the trunk alone,
and the assembled MoE is anchor + trained expert, with the seed left out.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from safetensors import safe_open
from typer.testing import CliRunner

from mfgguf.cli.app import app
from mfgguf.config import ModelConfig, get_preset
from mfgguf.converters.assemble import assemble
from mfgguf.train.experts.pooled import pool_router_stats
from mfgguf.flops import trunk_step_flops
from mfgguf.run import RunDir, read_module_meta
from mfgguf.train.experts.expert import build_expert_model, train_expert
from mfgguf.options import TrainOptions
from mfgguf.train.engine.loop import validation_losses
from mfgguf.train.rounds.restat import trunk_validation_loss
from mfgguf.train.whole.trunk import train_trunk

from tests.conftest import TINY_EXPERTS, copy_run
from tests.converters import llama_logits, reference_logits, rel_diff, text_sample


def read_gguf_tensors(path):
    """(name, numpy-order shape) of every tensor, by gguf-py's reader."""
    from gguf import GGUFReader

    return [(t.name, tuple(int(d) for d in reversed(t.shape.tolist()))) for t in GGUFReader(str(path)).tensors]


@pytest.fixture(scope="module")
def seeded_run(prepared_run, tmp_path_factory):
    root = copy_run(prepared_run, tmp_path_factory.mktemp("seeded") / "run")
    train_trunk(root, preset="tiny", options=TrainOptions(tokens=20_000, seed_expert=True), progress=False)
    return root


def test_trunk_file_holds_the_seed_and_counts_its_flops(seeded_run):
    meta = read_module_meta(RunDir(seeded_run), 0)
    cfg = ModelConfig.from_dict(meta["config"])
    assert cfg.seed_expert and cfg.trunk_ff == cfg.anchor_ff + cfg.expert_ff
    with safe_open(str(RunDir(seeded_run).module_file(0)), "np") as f:
        names = set(f.keys())
        seed = f.get_tensor("blk.0.ffn_down_seed.weight")
    assert {f"blk.{l}.ffn_{p}_seed.weight" for l in range(cfg.n_layers) for p in ("gate", "up", "down")} <= names
    assert np.abs(seed).max() > 0  # trained, not a zero placeholder
    # a seeded trunk step costs exactly what a dense step of width anchor_ff + expert_ff costs
    dense = ModelConfig.from_dict({**meta["config"], "seed_expert": False, "anchor_ff": cfg.trunk_ff})
    assert trunk_step_flops(cfg).total == trunk_step_flops(dense).total
    assert meta["flops_per_token"] == trunk_step_flops(cfg).total


def test_expert_step_zero_is_the_trunk_alone(seeded_run):
    rd = RunDir(seeded_run)
    meta = read_module_meta(rd, 0)
    cfg = ModelConfig.from_dict(meta["config"])
    model = build_expert_model(rd, cfg, 0, torch.device("cpu"), bf16_trunk=False, init="auto")
    got = validation_losses(rd.validation_dir, model, 2048, "single", torch.device("cpu"), "fp32")
    want = trunk_validation_loss(rd, rd.module_file(0), {**meta, "precision": "fp32", "train": {"eval_tokens": 2048}})
    for d in want:
        assert got[d] == pytest.approx(want[d], rel=1e-6)
    random_init = build_expert_model(rd, cfg, 0, torch.device("cpu"), bf16_trunk=False, init="random")
    assert not torch.equal(random_init.layers[0].experts[0].down.weight, model.layers[0].experts[0].down.weight)


def test_trunk_alone_gguf_is_anchor_plus_seed(seeded_run, tmp_path):
    out = tmp_path / "trunk.gguf"
    assemble(seeded_run, out, quant="f32", experts=[], progress=False)
    cfg = ModelConfig.from_dict(read_module_meta(RunDir(seeded_run), 0)["config"])
    shapes = {n: s for n, s in read_gguf_tensors(out)}
    assert shapes["blk.0.ffn_down.weight"] == (cfg.dim, cfg.anchor_ff + cfg.expert_ff)
    from tokenizers import Tokenizer

    ids = Tokenizer.from_file(str(seeded_run / "tokenizer.json")).encode(text_sample()).ids[:64]
    got = llama_logits(out, ids, 64)
    ref, _ = reference_logits(seeded_run, out, ids)
    assert rel_diff(got, ref) <= 1e-3, rel_diff(got, ref)


def test_moe_from_seeded_experts_matches_reference(seeded_run, tmp_path):
    run = copy_run(seeded_run, tmp_path / "run")
    for i in range(1, TINY_EXPERTS + 1):
        train_expert(run, i, options=TrainOptions(tokens=4096), progress=False)
    pool_router_stats(run, progress=False)
    out = tmp_path / "moe.gguf"
    assemble(run, out, quant="f32", top_k=1, progress=False)
    assert not any("seed" in n for n, _ in read_gguf_tensors(out))
    from tokenizers import Tokenizer

    ids = Tokenizer.from_file(str(run / "tokenizer.json")).encode(text_sample()).ids[:64]
    ref, _ = reference_logits(run, out, ids)
    assert rel_diff(llama_logits(out, ids, 64), ref) <= 1e-3


def test_init_seed_without_a_seed_is_one_line(trained_run, tmp_path):
    run = copy_run(trained_run, tmp_path / "run")
    r = CliRunner().invoke(app, ["train-expert", str(run), "--expert", "1", "--init", "seed", "--tokens", "1024",
                                 "--no-progress"])
    assert r.exit_code == 1
    assert "--seed-expert" in r.output and "Traceback" not in r.output
    assert get_preset("tiny").model.seed_expert is False
