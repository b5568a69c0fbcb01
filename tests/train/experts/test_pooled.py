"""`mfgguf router-stats`: the router's second moment pooled once per run, the same as the experts' own would pool."""

from __future__ import annotations

import json

import numpy as np
import torch
from safetensors.numpy import load_file
from typer.testing import CliRunner

from mfgguf.cli.app import app
from mfgguf.config import ModelConfig
from mfgguf.converters.assemble import assemble
from mfgguf.run import STATS_PREFIX, RunDir, read_module_meta, router_stats_current
from mfgguf.train.experts.expert import build_expert_model
from mfgguf.train.engine.weights import read_safetensors
from mfgguf.train.engine.loop import evaluate, load_tokens
from mfgguf.train.experts.stats import RouterStats
from mfgguf.train.experts.tailstats import moments_path, read_moments

from tests.conftest import TINY_EXPERTS, copy_run

REL = 0.15  # a recorded second moment's relative distance (Frobenius) from a pass's: 0.05-0.09 on the tiny run


def _cli(*args):
    r = CliRunner().invoke(app, [str(a) for a in args])
    return r.exit_code, r.output


def _pass_moments(rd: RunDir, cfg: ModelConfig, tokens: int):
    """Each expert's (count, {tensor: f32}) of a forward pass of trunk + that expert over its shard."""
    model = build_expert_model(rd, cfg, 0, torch.device("cpu"), bf16_trunk=False, trunk_path=rd.module_file(0))
    for i in range(1, TINY_EXPERTS + 1):
        model.load_expert({k: t for k, t in read_safetensors(rd.module_file(i)) if k.startswith("blk.")})
        st = RouterStats(cfg.n_layers, cfg.dim, second_moment=True)
        evaluate(model, load_tokens(rd.shard(i), "shard"), tokens, "single", torch.device("cpu"),
                 read_module_meta(rd, i)["precision"], hook=st.hook)
        yield i, st.n, st.tensors()


def test_pooled_takes_the_moments_each_expert_recorded_and_they_measure_what_a_pass_does(trained_run):
    """By default G = sum_i n_i M_i / sum_i n_i with each M_i the one expert i's last training steps recorded
    (tailstats.py, beside the module): no forward pass. Those steps' windows are training's own and the expert
    still moves under them, so M_i is close to, not equal to, a pass's over the shard."""
    rd = RunDir(trained_run)
    cfg = ModelConfig.from_dict(read_module_meta(rd, 0)["config"])
    pooled = json.loads(rd.router_stats_meta.read_text())
    assert pooled["router_stats_on"].endswith(", from the experts' last training steps"), pooled
    own = {i: read_moments(rd, i, read_module_meta(rd, i)["sha256"], cfg.n_layers, cfg.dim) for i in range(1, TINY_EXPERTS + 1)}
    assert all(m is not None for m in own.values())
    n = sum(m.n for m in own.values())
    assert pooled["router_stats_count"] == n
    got = load_file(rd.router_stats)
    for l in range(cfg.n_layers):
        want = sum(m.sq[l].numpy() for m in own.values()) / n
        np.testing.assert_allclose(got[f"{STATS_PREFIX}blk.{l}.second_moment"], want, rtol=1e-5, atol=1e-6)
    for i, _, t in _pass_moments(rd, cfg, pooled["tokens_per_source"]):
        for l in range(cfg.n_layers):
            a, b = t[f"{STATS_PREFIX}blk.{l}.second_moment"].double().numpy(), own[i].sq[l].numpy() / own[i].n
            assert np.linalg.norm(a - b) / np.linalg.norm(a) < REL, (i, l, np.linalg.norm(a - b) / np.linalg.norm(a))
            assert np.allclose(b, b.T)  # the file keeps the upper triangle; the lower mirrors it


def test_forward_pass_equals_the_experts_own_second_moments_pooled_by_count(trained_run, tmp_path):
    """`--forward-pass`: G = sum_i n_i M_i / sum_i n_i, each M_i measured on trunk + expert i over its shard (what
    module format 1 stored per expert), over as many tokens as each expert's recorded mean (the very tokens, for
    a `--stats-from pass` expert)."""
    run = copy_run(trained_run, tmp_path / "run")
    code, text = _cli("router-stats", run, "--forward-pass", "--no-progress")
    assert code == 0 and "training steps" not in text, text
    rd = RunDir(run)
    cfg = ModelConfig.from_dict(read_module_meta(rd, 0)["config"])
    pooled = json.loads(rd.router_stats_meta.read_text())
    G = [np.zeros((cfg.dim, cfg.dim)) for _ in range(cfg.n_layers)]
    n = 0
    for i, count, t in _pass_moments(rd, cfg, pooled["tokens_per_source"]):
        meta = read_module_meta(rd, i)
        assert count == meta["router_stats_count"]
        own = load_file(rd.module_file(i))
        for l in range(cfg.n_layers):
            a, b = t[f"{STATS_PREFIX}blk.{l}.mean"].numpy(), own[f"{STATS_PREFIX}blk.{l}.mean"]
            if meta["router_stats_from"] == "pass":
                np.testing.assert_allclose(a, b, rtol=1e-3, atol=1e-3)
            else:  # gathered by training's last steps (tailstats.py): other windows, the same quantity
                assert a @ b / np.linalg.norm(a) / np.linalg.norm(b) > 0.98, (i, l)
            G[l] += count * t[f"{STATS_PREFIX}blk.{l}.second_moment"].double().numpy()
        n += count
    got = load_file(rd.router_stats)
    assert pooled["router_stats_count"] == n and pooled["source"] == "experts"
    for l in range(cfg.n_layers):
        np.testing.assert_allclose(got[f"{STATS_PREFIX}blk.{l}.second_moment"], G[l] / n, rtol=1e-3, atol=1e-4)
    assert router_stats_current(rd)


def test_a_retrained_expert_makes_them_stale_and_router_stats_fixes_it(trained_run, tmp_path):
    from mfgguf.options import TrainOptions
    from mfgguf.train.experts.expert import train_expert

    run = copy_run(trained_run, tmp_path / "run")
    train_expert(run, 2, options=TrainOptions(tokens=2048), restart=True, progress=False)
    assert not router_stats_current(RunDir(run))
    out = tmp_path / "m.gguf"
    code, text = _cli("assemble", run, "-o", out, "-q")  # runs the pass itself, saying so in one line
    assert code == 0 and out.is_file(), text
    assert "predate expert_002" in text and "mfgguf router-stats" in text, text
    assert router_stats_current(RunDir(run))
    train_expert(run, 2, options=TrainOptions(tokens=3072), restart=True, progress=False)  # stale again: `router-stats` fixes it too
    assert not router_stats_current(RunDir(run))
    code, text = _cli("router-stats", run, "--no-progress")
    assert code == 0 and "second moments over" in text, text
    assert router_stats_current(RunDir(run))
    assert assemble(run, tmp_path / "m2.gguf", quant="f32", progress=False)["router"] == "ridge"


def test_router_stats_needs_every_expert(trained_run, tmp_path):
    run = copy_run(trained_run, tmp_path / "run")
    RunDir(run).module_meta(3).unlink()
    code, text = _cli("router-stats", run, "--no-progress")
    assert code == 1 and text.startswith("error: expert_003 is not trained yet") and len(text.strip().splitlines()) == 1, text


def test_an_expert_without_recorded_moments_is_measured_by_a_pass(trained_run, tmp_path):
    """Moments absent (a `--stats-from pass` expert, or one from an earlier version) or of another module: that
    expert alone gets the forward pass, and the record says how many came from training."""
    run = copy_run(trained_run, tmp_path / "run")
    rd = RunDir(run)
    moments_path(rd, 2).unlink()
    code, text = _cli("router-stats", run, "--no-progress")
    assert code == 0 and f"{TINY_EXPERTS - 1} of {TINY_EXPERTS} experts from their last training steps" in text, text
    mixed = load_file(rd.router_stats)
    code, text = _cli("router-stats", run, "--tokens", 4096, "--no-progress")  # --tokens: a pass over every expert
    assert code == 0 and "training steps" not in text, text
    assert not np.allclose(mixed[f"{STATS_PREFIX}blk.0.second_moment"], load_file(rd.router_stats)[f"{STATS_PREFIX}blk.0.second_moment"])


def test_a_damaged_moments_file_is_named_and_that_expert_measured_by_a_forward_pass(trained_run, tmp_path):
    """`assemble` on a RUN whose pooled statistics are missing and one of whose recorded moments files was cut short:
    one line names the file, that expert alone is measured by a forward pass, and the GGUF is written."""
    run = copy_run(trained_run, tmp_path / "run")
    rd = RunDir(run)
    rd.router_stats.unlink()
    rd.router_stats_meta.unlink()
    cut = moments_path(rd, 2)
    cut.write_bytes(cut.read_bytes()[:100])
    code, text = _cli("assemble", run, "-o", tmp_path / "moe.gguf", "--quant", "f32", "-q")
    assert code == 0, text
    assert f"{cut} is damaged" in text and "Traceback" not in text
    pooled = json.loads(rd.router_stats_meta.read_text())
    assert pooled["router_stats_on"].endswith(f", {TINY_EXPERTS - 1} of {TINY_EXPERTS} experts from their last"
                                              " training steps"), pooled
    assert (tmp_path / "moe.gguf").stat().st_size > 0
