"""Sync rounds (`train-expert --rounds R`, `mfgguf sync`): the merge between rounds, experts that
continue from the merged trunk with their own state, the final statistics pass on the merged
model, a sync killed mid-publish that finishes with the same bytes, and a SIGKILLed round that
resumes exactly."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file
from typer.testing import CliRunner

from mfgguf.cli.app import app
from mfgguf.converters.assemble import assemble
from mfgguf.modules.merge import merge_arrays
from mfgguf.errors import MfggufError
from mfgguf.run import (SHARED_PREFIX, STATS_PREFIX, RunDir, router_stats_current, router_stats_stale, sha256_file,
                        update_manifest)
from mfgguf.train.experts.expert import train_expert
from mfgguf.options import TrainOptions
from mfgguf.train.experts.pooled import pool_router_stats
from mfgguf.train.rounds.ends import round_end
from mfgguf.train.rounds.adopt import ON
from mfgguf.train.experts.tailstats import read_moments
from mfgguf.train.rounds.sync import sync
from tests.conftest import TINY_EXPERTS, copy_run
from tests.converters import llama_logits, reference_logits, rel_diff, text_sample

R = 2
EXPERTS = range(1, TINY_EXPERTS + 1)


def _round(run: Path, **kw) -> list[dict]:
    return [train_expert(run, i, progress=False, options=TrainOptions(shared="attn", rounds=R), **kw) for i in EXPERTS]


def _meta(run: Path, i: int) -> dict:
    return json.loads(RunDir(run).module_meta(i).read_text())


def _cli(*args):
    r = CliRunner().invoke(app, [str(a) for a in args])
    return r.exit_code, r.output.strip()


def _sync_inputs(run: Path) -> tuple[RunDir, dict, dict, list[int]]:
    """What a sync of `run` reads: the run, its trunk's tensors, each expert's tensors, their tokens."""
    rd = RunDir(run)
    return (rd, load_file(rd.module_file(0)), {i: load_file(rd.module_file(i)) for i in EXPERTS},
            [_meta(run, i)["tokens_seen"] for i in EXPERTS])


def _copy_mid_run(src: Path, dst: Path) -> Path:
    """copy_run plus the experts' checkpoints: between rounds they are part of the run's state."""
    run = copy_run(src, dst)
    for i in EXPERTS:
        shutil.copytree(RunDir(src).checkpoint_dir(i), RunDir(run).checkpoint_dir(i))
    return run


@pytest.fixture(scope="module")
def round1(trained_run, tmp_path_factory):
    """trained_run's trunk; every expert has trained round 1 of 2 with --shared attn."""
    run = copy_run(trained_run, tmp_path_factory.mktemp("sync") / "run")
    _round(run)
    return run


@pytest.fixture(scope="module")
def last_round(round1, tmp_path_factory):
    """round1 synced and round 2 trained: the run as its final sync finds it."""
    run = _copy_mid_run(round1, tmp_path_factory.mktemp("sync") / "run")
    sync(run, progress=False)
    _round(run)
    return run


@pytest.fixture(scope="module")
def finished(last_round, tmp_path_factory):
    """last_round after a final sync with the statistics pass: what `mfgguf assemble` gets."""
    run = copy_run(last_round, tmp_path_factory.mktemp("sync") / "run")
    sync(run, progress=False, stats_from="pass")
    return run


def test_a_round_writes_ffn_and_copies_and_keeps_its_checkpoint(round1):
    rd = RunDir(round1)
    for i in EXPERTS:
        m = _meta(round1, i)
        steps = m["train"]["tokens"] // (m["train"]["batch_size"] * m["config"]["ctx_len"])
        assert (m["round"], m["rounds"], m["steps"]) == (1, R, round_end(steps, R, 1)) and m["steps"] < steps
        assert m["validation_loss"] == {}  # nothing is decided on a round's end: it is not scored
        t = load_file(rd.module_file(i))
        assert any(k.startswith(SHARED_PREFIX) for k in t) and not any(k.startswith(STATS_PREFIX) for k in t)
        state = json.loads((rd.checkpoint_dir(i) / "state.json").read_text())
        assert state["step"] == m["steps"]  # the next round starts from here
    code, out = _cli("assemble", round1, "-o", round1 / "x.gguf")  # an unfinished expert is not assembled
    assert code == 1 and "round 1 of 2" in out and "mfgguf sync" in out and len(out.splitlines()) == 1
    assert not (round1 / "x.gguf").exists()


def test_sync_writes_the_token_weighted_mean_and_experts_continue_from_it(round1, tmp_path):
    run = _copy_mid_run(round1, tmp_path / "run")
    rd, old, copies, tokens = _sync_inputs(run)
    old_sha = _meta(run, 0)["sha256"]
    code, out = _cli("sync", run, "--no-progress")
    assert code == 0, out
    assert out.startswith("sync 1/2:") and "experts continue with round 2" in out
    t, m = load_file(rd.module_file(0)), _meta(run, 0)
    assert (m["syncs"], m["final"], m["synced_from"]) == (1, False, old_sha)
    assert m["sha256"] == sha256_file(rd.module_file(0))
    merged = set(m["sync"]["merged_tensors"])
    assert merged == {k[len(SHARED_PREFIX):] for k in copies[1] if k.startswith(SHARED_PREFIX)}
    for name, v in t.items():
        want = merge_arrays("mean", old[name], [copies[i][SHARED_PREFIX + name] for i in EXPERTS], tokens) \
            if name in merged else old[name]
        assert np.array_equal(v, want), name
    # the inputs are kept: rounds/sync_01/before holds the trunk and experts the merge read
    before = rd.rounds / "sync_01" / "before"
    assert sha256_file(before / "trunk.safetensors") == old_sha
    # round 2: the expert's FFN continues from its round-1 state; its shared copies from the merged trunk
    m2 = train_expert(run, 1, progress=False, options=TrainOptions(shared="attn", rounds=R))
    assert (m2["round"], m2["resumed_from_step"]) == (2, _meta(round1, 1)["steps"])
    assert m2["history"][: m2["resumed_from_step"]] == _meta(round1, 1)["history"]
    assert m2["trunk_sha256"] == m["sha256"]
    # asking for another R than the run's fails clearly
    with pytest.raises(MfggufError, match="--rounds is 1"):
        train_expert(run, 2, progress=False, options=TrainOptions(shared="attn", rounds=1))


def test_final_sync_recomputes_statistics_on_the_merged_model(finished, round1, tmp_path):
    rd = RunDir(finished)
    trunk = _meta(finished, 0)
    assert (trunk["syncs"], trunk["rounds"], trunk["final"]) == (2, 2, True)
    for i in EXPERTS:
        m, t = _meta(finished, i), load_file(rd.module_file(i))
        assert m["shared_merged"] and m["trunk_sha256"] == trunk["sha256"] and m["round"] == 2
        assert m["router_stats_on"] == "merged trunk" and m["router_stats_count"] > 0
        assert not any(k.startswith(SHARED_PREFIX) for k in t)  # the copies live in the trunk now
        assert m["validation_loss"] != m["premerge"]["validation_loss"]
        before = load_file(rd.rounds / "sync_02" / "before" / rd.module_file(i).name)
        for l in range(m["config"]["n_layers"]):  # merged inputs move the statistics
            k = f"{STATS_PREFIX}blk.{l}.mean"
            assert not np.array_equal(t[k], before[k])
        assert not rd.checkpoint_dir(i).exists()  # the last round removes the checkpoint as before
    # The router's pooled G came from those same passes, no second one: equal to a fresh `router-stats`.
    pooled = json.loads(rd.router_stats_meta.read_text())
    assert router_stats_current(rd) and pooled["source"] == "experts"
    assert pooled["router_stats_count"] == sum(_meta(finished, i)["router_stats_count"] for i in EXPERTS)
    again = copy_run(finished, tmp_path / "again")
    pool_router_stats(again, progress=False)
    g0, g1 = load_file(rd.router_stats), load_file(RunDir(again).router_stats)
    assert all(np.allclose(g0[k], g1[k], rtol=1e-5, atol=1e-6) for k in g0)
    code, out = _cli("sync", finished)
    assert code == 1 and "already synced after its last round" in out
    code, out = _cli("train-expert", finished, "--expert", "1", "--shared", "attn", "--rounds", "2", "--no-progress")
    assert code == 1 and "final" in out


def test_final_sync_takes_the_last_rounds_statistics_without_a_pass(last_round, finished, tmp_path):
    """The default: the means and second moments the last round's steps recorded (adopt.py), no forward pass;
    the module is the pass's but for its means, and G pools the moments the experts wrote."""
    run = copy_run(last_round, tmp_path / "run")
    rd, fin = RunDir(run), RunDir(finished)
    before = {i: load_file(rd.module_file(i)) for i in EXPERTS}
    L = _meta(run, 0)["config"]["n_layers"]
    cfg = _meta(run, 0)["config"]
    moments = {i: read_moments(rd, i, _meta(run, i)["sha256"], L, cfg["dim"]) for i in EXPERTS}
    code, out = _cli("sync", run, "--no-progress")
    assert code == 0 and f"router statistics of {TINY_EXPERTS} experts from their last round's steps" in out, out
    trunk = _meta(run, 0)
    assert trunk["sha256"] == _meta(finished, 0)["sha256"]  # the same merge
    for i in EXPERTS:
        m, t, passed = _meta(run, i), load_file(rd.module_file(i)), load_file(fin.module_file(i))
        assert m["shared_merged"] and m["trunk_sha256"] == trunk["sha256"] and m["restat_tokens"] == 0
        assert m["router_stats_on"] == ON and m["validation_on"] == "own trunk copy"
        assert m["validation_loss"] == m["premerge"]["validation_loss"]  # not re-scored, and it says so
        assert set(t) == set(passed)  # FFNs and means; the copies live in the trunk now
        for k, v in t.items():
            want = before[i][k] if k.startswith(STATS_PREFIX) else passed[k]
            assert np.array_equal(v, want), k
    counts = [_meta(run, i)["router_stats_count"] for i in EXPERTS]
    g = load_file(rd.router_stats)
    assert router_stats_current(rd) and json.loads(rd.router_stats_meta.read_text())["router_stats_count"] == sum(counts)
    for l in range(L):
        k = f"{STATS_PREFIX}blk.{l}.second_moment"
        assert [moments[i].n for i in EXPERTS] == counts
        want = sum(moments[i].sq[l].numpy() for i in EXPERTS) / sum(counts)
        assert np.allclose(g[k], want, rtol=1e-5, atol=1e-6), k
    assert not (rd.rounds / "moments").exists() or not any((rd.rounds / "moments").iterdir())
    code, out = _cli("assemble", run, "-o", tmp_path / "x.gguf")
    assert code == 0, out
    code, out = _cli("sync", copy_run(last_round, tmp_path / "bad"), "--stats-from", "guess")
    assert code == 1 and "--stats-from" in out and len(out.splitlines()) == 1


def test_the_assembled_synced_model_matches_the_reference(finished, tmp_path):
    from tokenizers import Tokenizer

    ids = Tokenizer.from_file(str(finished / "tokenizer.json")).encode(text_sample()).ids[:64]
    out = tmp_path / "m.gguf"
    r = assemble(finished, out, quant="f32", top_k=2, progress=False)
    assert r["merged_tensors"] == 0  # sync merged already: assembly writes the synced trunk as is
    got = llama_logits(out, ids, 64)
    ref, _ = reference_logits(finished, out, ids)
    assert rel_diff(got, ref) <= 1e-3, rel_diff(got, ref)


def test_a_held_out_expert_sits_out_every_sync(round1, tmp_path):
    """`sync --experts 1,2`: expert 3 (a domain held out of training, or added later by `extend`) takes no part:
    the merge is the mean of the others' copies, later syncs keep the set, and the final one gives statistics to them only."""
    run = _copy_mid_run(round1, tmp_path / "run")
    rd, old, copies, tokens = _sync_inputs(run)
    three = sha256_file(rd.module_file(3))
    code, out = _cli("sync", run, "--experts", "1,2", "--no-progress")
    assert code == 0 and "from 2 experts" in out, out
    t, m = load_file(rd.module_file(0)), _meta(run, 0)
    assert m["sync"]["expert_ids"] == [1, 2]
    for name in m["sync"]["merged_tensors"]:
        want = merge_arrays("mean", old[name], [copies[i][SHARED_PREFIX + name] for i in (1, 2)], tokens[:2])
        assert np.array_equal(t[name], want), name
    for i in (1, 2):
        train_expert(run, i, progress=False, options=TrainOptions(shared="attn", rounds=R))
    code, out = _cli("sync", run, "--experts", "1-3")  # another set than round 1's: one line, nothing written
    assert code == 1 and "--experts 1,2" in out and len(out.splitlines()) == 1
    code, out = _cli("sync", run, "--no-progress")  # no --experts: the set the first sync recorded
    assert code == 0 and "from 2 experts" in out and "router statistics of 2 experts from their last round" in out, out
    assert [_meta(run, i).get("shared_merged") for i in EXPERTS] == [True, True, None]
    assert sha256_file(rd.module_file(3)) == three
    assert router_stats_current(rd, [1, 2]) and not router_stats_current(rd)
    code, out = _cli("sync", run)
    assert code == 1 and "already synced after its last round" in out
    # the expert that sat out trains later as a plain expert on the merged trunk; a synced one may not
    code, out = _cli("train-expert", run, "--expert", "1", "--no-progress")
    assert code == 1 and "sat out the syncs" in out and len(out.splitlines()) == 1
    m3 = train_expert(run, 3, progress=False, restart=True)  # its round-1 checkpoint (it trained one here) goes
    assert m3["trunk_sha256"] == _meta(run, 0)["sha256"] and not m3.get("shared_tensors")
    pooled = json.loads(rd.router_stats_meta.read_text())  # over 1 and 2: assembly with 3 pools again, and says why
    assert router_stats_stale(pooled, m3["trunk_sha256"], {"expert_003": m3["sha256"]}) == "cover other experts, not expert_003"
    from mfgguf.train.experts.pooled import pool_router_stats

    r = assemble(run, tmp_path / "all.gguf", quant="f32", progress=False)
    assert r["experts"] == list(EXPERTS) and r["merged_tensors"] == 0


def test_an_imported_base_is_scored_as_its_experts_score_themselves():
    from mfgguf.train.rounds.restat import trunk_scoring

    trunk = {"source": "base", "precision": "fp32", "train": {"eval_tokens": 65_536}}
    experts = [{"precision": "bf16", "train": {"eval_tokens": 4_096}}, {"precision": "bf16", "train": {"eval_tokens": 2_048}}]
    assert trunk_scoring(trunk, experts) == (4_096, "bf16")  # 6 minutes a sync on SmolLM2 at (65,536, fp32)
    assert trunk_scoring({**trunk, "source": None}, experts) == (65_536, "fp32")  # trained here: its own settings


def test_a_killed_sync_finishes_with_the_same_bytes(round1, tmp_path):
    from mfgguf.train.rounds import sync as sync_mod
    whole, killed = (_copy_mid_run(round1, tmp_path / name) for name in ("whole", "killed"))
    sync(whole, progress=False)
    # the state a SIGKILL after the first rename leaves: plan staged, trunk file replaced, its JSON not
    rd = RunDir(killed)
    info = rd.run_info()
    plan_file = sync_mod._stage(rd, info, list(EXPERTS), "mean", "cpu", False)
    os.replace(plan_file.parent / "after" / "trunk.safetensors", rd.module_file(0))
    for args in (["train-expert", killed, "--expert", "1", "--shared", "attn", "--rounds", "2", "--no-progress"],
                 ["assemble", killed, "-o", tmp_path / "x.gguf"]):
        code, out = _cli(*args)
        assert code == 1 and "was interrupted" in out and "mfgguf sync" in out, out
    code, out = _cli("sync", killed, "--no-progress")
    assert code == 0, out
    for i in range(0, TINY_EXPERTS + 1):
        a, b = RunDir(whole), RunDir(killed)
        assert sha256_file(a.module_file(i)) == sha256_file(b.module_file(i))
        assert a.module_meta(i).read_text() == b.module_meta(i).read_text()
    assert json.loads(plan_file.read_text())["state"] == "published"


def test_a_sigkilled_round_resumes_exactly(round1, tmp_path):
    """Round 2 killed after its first checkpoint, resumed: the same module as an uninterrupted round 2."""
    whole, killed = (_copy_mid_run(round1, tmp_path / name) for name in ("whole", "killed"))
    for run in (whole, killed):
        sync(run, progress=False)
    a = train_expert(whole, 1, progress=False, options=TrainOptions(shared="attn", rounds=R))  # tiny: checkpoints every 10 steps
    state = RunDir(killed).checkpoint_dir(1) / "state.json"
    start = json.loads(state.read_text())["step"]
    cmd = [sys.executable, "-c", "from mfgguf.cli.app import main; main()", "train-expert", str(killed), "--expert", "1",
           "--shared", "attn", "--rounds", str(R), "--no-progress"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, cwd=Path(__file__).parents[3],
                            env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[3])})
    deadline = time.monotonic() + 120
    try:
        while json.loads(state.read_text() or "{}").get("step", start) == start:
            assert proc.poll() is None, f"round 2 exited before a checkpoint: {proc.stderr.read()!r}"
            assert time.monotonic() < deadline, "no checkpoint within 120 s"
            time.sleep(0.005)
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.wait()
    assert _meta(killed, 1)["round"] == 1, "round 2 finished before it was killed"
    b = train_expert(killed, 1, progress=False, options=TrainOptions(shared="attn", rounds=R))
    assert b["resumed_from_step"] > start
    assert a["history"] == b["history"]
    assert sha256_file(RunDir(whole).module_file(1)) == sha256_file(RunDir(killed).module_file(1))


def test_bad_rounds_one_clear_line(trained_run, tmp_path):
    run = copy_run(trained_run, tmp_path / "run")
    code, out = _cli("train-expert", run, "--expert", "1", "--rounds", "2", "--no-progress")
    assert code == 1 and "--shared" in out and len(out.splitlines()) == 1
    code, out = _cli("train-expert", run, "--expert", "1", "--shared", "attn", "--rounds", "0", "--no-progress")
    assert code == 1 and "--rounds must be" in out
    code, out = _cli("sync", run)  # experts trained with --shared none: nothing to merge
    assert code == 1 and "share no trunk tensors" in out
    before = sha256_file(RunDir(run).module_file(0))
    RunDir(run).module_meta(2).unlink()
    RunDir(run).module_file(2).unlink()
    kept = sorted(RunDir(run).rounds.rglob("*"))  # the experts' second moments, from their training
    code, out = _cli("sync", run)
    assert code == 1 and "train-expert" in out and "--expert 2" in out
    assert sha256_file(RunDir(run).module_file(0)) == before and sorted(RunDir(run).rounds.rglob("*")) == kept


def test_final_sync_without_restat_then_restat_per_expert_gives_the_same_files(finished, tmp_path):
    """The cluster path: `sync --no-restat`, then `restat --expert I` in separate processes, in any order."""
    src = RunDir(finished).rounds / "sync_02" / "before"  # the run as it was before its final sync
    run = copy_run(finished, tmp_path / "run")
    rd = RunDir(run)
    shutil.rmtree(rd.rounds / "sync_02")
    for i in range(0, TINY_EXPERTS + 1):
        for f in (rd.module_file(i), rd.module_meta(i)):
            shutil.copy2(src / f.name, f)
        update_manifest(rd, i, json.loads(rd.module_meta(i).read_text()))
    code, out = _cli("sync", run, "--no-restat", "--no-progress")
    assert code == 0 and "mfgguf restat" in out, out
    code, out = _cli("assemble", run, "-o", tmp_path / "x.gguf")
    assert code == 1 and "mfgguf restat RUN --expert 1" in out and len(out.splitlines()) == 1
    for i in reversed(EXPERTS):
        code, out = _cli("restat", run, "--expert", i)
        assert code == 0 and "router statistics over" in out, out
    code, out = _cli("restat", run, "--expert", 1)
    assert code == 0 and "already" in out
    for i in range(0, TINY_EXPERTS + 1):
        assert sha256_file(rd.module_file(i)) == sha256_file(RunDir(finished).module_file(i)), i
    code, out = _cli("sync", run)
    assert code == 1 and "already synced after its last round" in out


def test_eval_of_a_synced_run_also_measures_the_trunk_as_trained(finished, tmp_path):
    from mfgguf.eval.evaluate import EvalConfig, evaluate

    r = evaluate(finished, tmp_path / "eval", EvalConfig(routers=("ridge",), top_ks=(1,), quants=(), dense=False))
    before, after = r["results"]["trunk as trained (before sync)"], r["results"]["trunk alone"]
    assert before["overall"]["ppl"] != after["overall"]["ppl"]  # the merged copies changed the trunk
    assert "moe_over_trained_trunk_worst_domain" in r["goals"]
    assert "before any sync" in (tmp_path / "eval" / "report.md").read_text()
    rc = r["recipe"]  # how the run was made, in the report
    assert (rc["experts"], rc["shared"], rc["rounds"], rc["merge"], rc["outer_momentum"]) == (TINY_EXPERTS, "attn", R, "mean", 0.0)
    assert "Recipe: experts 3" in (tmp_path / "eval" / "report.md").read_text()


# ---- a RUN synced with --outer-lr / --outer-momentum, which mfgguf removed ---------------------------------


def test_a_run_synced_with_the_removed_outer_step_is_refused_in_one_line(round1, tmp_path):
    run = _copy_mid_run(round1, tmp_path / "outer")
    rd = RunDir(run)
    (rd.rounds / "outer.safetensors").write_bytes(b"")  # the momentum an old sync left
    before = sha256_file(rd.module_file(0))
    code, out = _cli("sync", run, "--no-progress")
    assert code == 1 and "--outer-lr / --outer-momentum" in out and "2a0bd6e" in out, out
    assert len(out.splitlines()) == 1 and "Traceback" not in out
    assert sha256_file(rd.module_file(0)) == before
    assert _cli("sync", run, "--outer-lr", "0.7")[0] == 2  # no longer an option
