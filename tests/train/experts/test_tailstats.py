"""Router statistics gathered by training's last steps (tailstats.py): once per token under recompute,
the same quantity as the pass after training, and only from the steps they are meant to cover."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
from safetensors.torch import load_file

from mfgguf.config import ModelConfig, get_preset
from mfgguf.errors import MfggufError
from mfgguf.options import TrainOptions
from mfgguf.run import STATS_PREFIX, RunDir
from mfgguf.train.engine.driver import get_batch
from mfgguf.train.experts.expert import build_expert_model, expert_params, train_expert
from mfgguf.train.engine.loop import InMemorySteps, forward_loss, load_tokens
from mfgguf.train.engine.records import Checkpoints, StepSetup
from mfgguf.train.experts.stats import RouterStats
from mfgguf.train.experts.tailstats import TailStats, read_moments, tail_steps, write_moments
from tests.conftest import copy_run


def _model(rd: RunDir):
    cfg = ModelConfig.from_dict(json.loads(rd.module_meta(0).read_text())["config"])
    model = build_expert_model(rd, cfg, seed=0, dev=torch.device("cpu"), bf16_trunk=False)
    with torch.no_grad():  # an expert that does something, so layer 1's input depends on layer 0's expert
        for layer in model.layers:
            layer.experts[0].down.weight.normal_(0, 0.02)
    return cfg, model


@pytest.mark.parametrize("recompute", [False, True])
def test_each_token_is_counted_once(trained_run, recompute):
    """A checkpointed block runs its forward twice; the statistics still see each token once."""
    rd = RunDir(trained_run)
    cfg, model = _model(rd)
    x, y = get_batch(load_tokens(rd.shard(1), "shard"), 0, 1, 0, 4, cfg.ctx_len)  # (4, T)
    tail = TailStats(cfg.n_layers, cfg.dim, first_step=0, moments=True)
    forward_loss(model, x, y, "single", recompute=recompute, hook=tail.hook).backward()
    tail.commit()
    ref = RouterStats(cfg.n_layers, cfg.dim, second_moment=True)
    with torch.no_grad():
        model(x, route="single", hook=ref.hook)
    assert tail.stats.count == ref.count == [x.numel()] * cfg.n_layers
    for a, b in zip(tail.stats.sum, ref.sum):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    for a, b in zip(tail.stats.sq, ref.sq):  # the second moments the final sync pools (rounds/adopt.py)
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-5)
    state = TailStats(cfg.n_layers, cfg.dim, first_step=0, moments=True)
    state.load_state(tail.state_tensors())  # a resumed run continues from the same sums
    assert state.stats.count == tail.stats.count
    assert all(torch.equal(a, b) for a, b in zip(state.stats.sq, tail.stats.sq))


def test_moments_file_names_its_module(trained_run, tmp_path):
    """The moments wait beside the module they were measured with; another module's are not read."""
    rd = RunDir(copy_run(trained_run, tmp_path / "run"))
    cfg, model = _model(rd)
    x, _ = get_batch(load_tokens(rd.shard(1), "shard"), 0, 1, 0, 2, cfg.ctx_len)  # (2, T)
    stats = RouterStats(cfg.n_layers, cfg.dim, second_moment=True)
    with torch.no_grad():
        model(x, route="single", hook=stats.hook)
    write_moments(rd, 1, stats, "a" * 64)
    assert read_moments(rd, 1, "b" * 64, cfg.n_layers, cfg.dim) is None and read_moments(rd, 2, "a" * 64, cfg.n_layers, cfg.dim) is None
    back = read_moments(rd, 1, "a" * 64, cfg.n_layers, cfg.dim)
    assert back.count == stats.count
    for a, b in zip(back.sq, stats.sq):  # f32 on disk: sums back within f32 rounding
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-4)


def test_only_the_last_steps_are_gathered(trained_run, tmp_path):
    rd = RunDir(trained_run)
    cfg, model = _model(rd)
    tc = replace(get_preset("tiny").expert, tokens=6 * 4 * cfg.ctx_len, batch_size=4)
    per_step = tc.batch_size * cfg.ctx_len
    assert tail_steps(2 * per_step + 1, per_step, 6) == 3 and tail_steps(10**9, per_step, 6) == 6
    tail = TailStats(cfg.n_layers, cfg.dim, first_step=6 - tail_steps(2 * per_step, per_step, 6))
    impl = InMemorySteps(model, expert_params(model), tc, StepSetup(torch.device("cpu"), "fp32", "single", micro=2),
                         Checkpoints(tmp_path / "ck", {}), tail=tail)
    impl.resume()
    data = load_tokens(rd.shard(1), "shard")
    for s in range(6):
        impl.step(s, *get_batch(data, 0, 1, s, tc.batch_size, cfg.ctx_len), lr=tc.lr)
        assert tail.tokens == max(0, s - 3) * per_step  # steps 4 and 5 (0-based), two micro-batches each
    assert tail.tokens == 2 * per_step


def test_means_from_training_match_a_pass_after_it(trained_run, tmp_path):
    """The default (stats from the last steps) and --stats-from pass measure the same means; only
    the pass costs a forward over the shard."""
    runs = {k: copy_run(trained_run, tmp_path / k) for k in ("train", "pass")}
    metas = {k: train_expert(r, 1, options=TrainOptions(tokens=20_000, stats_from=k), progress=False)
             for k, r in runs.items()}
    assert metas["pass"]["router_stats_from"] == "pass"
    assert metas["train"]["router_stats_from"] == "training steps 8-39"  # 32 steps x 512 tokens = 4 x eval_tokens
    assert metas["train"]["router_stats_count"] == metas["pass"]["router_stats_count"] == 16_384
    assert metas["train"]["wall_breakdown_s"]["stats"] < 0.01 < metas["pass"]["wall_breakdown_s"]["stats"]
    t = {k: load_file(RunDir(r).module_file(1)) for k, r in runs.items()}
    for l in range(2):
        a, b = t["train"][f"{STATS_PREFIX}blk.{l}.mean"], t["pass"][f"{STATS_PREFIX}blk.{l}.mean"]
        assert torch.nn.functional.cosine_similarity(a, b, dim=0) > 0.99, l
        assert not torch.equal(a, b)  # other windows, weights still moving: close, not the same numbers
    # the expert itself trains identically either way
    assert torch.equal(t["train"]["blk.1.ffn_down.weight"], t["pass"]["blk.1.ffn_down.weight"])


def test_unknown_source_is_one_clear_error(trained_run, tmp_path):
    run = copy_run(trained_run, tmp_path / "run")
    with pytest.raises(MfggufError, match="unknown --stats-from 'both'; choose one of train, pass"):
        train_expert(run, 1, options=TrainOptions(tokens=2_000, stats_from="both"), progress=False)
