"""`--ffn-rounds K`: the last K sync rounds train the experts' FFNs only, against the merged trunk the MoE serves.

The rounds before them train attention copies that the syncs merge; the FFN-only rounds merge nothing, so the
final trunk is the one those rounds trained against, and the experts' held-out losses and router statistics
are of the model that is assembled, not of their own attention copies."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from safetensors.numpy import load_file
from typer.testing import CliRunner

from mfgguf.cli.app import app
from mfgguf.config import ModelConfig, shared_tensor_names
from mfgguf.converters.assemble import assemble
from mfgguf.flops import expert_step_flops, module_flops
from mfgguf.options import JobOptions, TrainOptions
from mfgguf.run import SHARED_PREFIX, RunDir, read_module_meta, sha256_file
from mfgguf.train.experts.expert import train_expert
from mfgguf.train.fanout.schedule import train_experts
from mfgguf.train.rounds.adopt import ON_FINAL
from mfgguf.train.rounds.sync import sync
from tests.conftest import TINY_EXPERTS
from tests.converters import llama_logits, reference_logits, rel_diff, text_sample

TOKENS = 10_240  # 20 tiny steps: 10 with attention copies, 10 FFN-only
OPTS = TrainOptions(tokens=TOKENS, shared="attn", rounds=2, ffn_rounds=1)
EXPERTS = range(1, TINY_EXPERTS + 1)


def _cli(*args):
    r = CliRunner().invoke(app, [str(a) for a in args])
    return r.exit_code, r.output.strip()


@pytest.fixture(scope="module")
def trunk_only(prepared_run, tmp_path_factory) -> Path:
    """The prepared run with a trained tiny trunk and no experts."""
    from mfgguf.train.whole.trunk import train_trunk

    root = tmp_path_factory.mktemp("ffn-rounds") / "run"
    shutil.copytree(prepared_run, root)
    train_trunk(root, preset="tiny", options=TrainOptions(tokens=TOKENS), progress=False)
    return root


@pytest.fixture(scope="module")
def before_final(trunk_only, tmp_path_factory) -> Path:
    """Round 1 (attention copies), its sync, round 2 (FFN only): the run as its final sync finds it."""
    run = tmp_path_factory.mktemp("ffn-rounds") / "run"
    shutil.copytree(trunk_only, run)
    for rnd in (1, 2):
        for i in EXPERTS:
            train_expert(run, i, progress=False, options=OPTS)
        if rnd == 1:
            sync(run, progress=False)
    return run


def test_the_last_round_trains_the_ffn_only_and_records_what_came_before(before_final):
    rd = RunDir(before_final)
    trunk = read_module_meta(rd, 0)
    for i in EXPERTS:
        m, t = read_module_meta(rd, i), load_file(rd.module_file(i))
        assert (m["round"], m["rounds"], m["shared"], m["shared_tensors"]) == (2, 2, "none", [])
        assert not any(k.startswith(SHARED_PREFIX) for k in t)  # nothing for the final sync to merge
        assert m["trunk_sha256"] == trunk["sha256"] and m["heldout_loss"]  # scored on the merged trunk
        half = TOKENS // 2
        assert m["shared_trained"] == {"shared": "attn", "tensors": shared_tensor_names(ModelConfig.from_dict(m["config"]), "attn"),
                                       "tokens": half} and m["tokens_seen"] == TOKENS
        # the FLOPs count the copies for the first round's tokens and the FFN alone after them
        cfg = m["config"]
        want = half * expert_step_flops(cfg, m["shared_trained"]["tensors"]).total + half * expert_step_flops(cfg).total
        assert module_flops(m) == pytest.approx(want, rel=1e-12)
        assert want < TOKENS * expert_step_flops(cfg, m["shared_trained"]["tensors"]).total


def test_the_final_sync_keeps_the_trunk_and_its_scores_are_of_the_served_model(before_final, tmp_path):
    """The default final sync adopts the last round's statistics; with no copies trained since the last merge,
    a forward pass on the final trunk (`--stats-from pass`) scores every expert as its training did."""
    runs = {}
    for how in ("train", "pass"):
        run = tmp_path / how
        shutil.copytree(before_final, run)
        synced_from = sha256_file(RunDir(run).module_file(0))
        code, out = _cli("sync", run, "--no-progress", "--stats-from", how)
        assert code == 0, out
        trunk = read_module_meta(RunDir(run), 0)
        assert trunk["final"] and trunk["sync"]["merged_tensors"] == []
        assert trunk["sha256"] == synced_from  # the FFN-only round left the trunk as the first sync made it
        runs[how] = run
    for i in EXPERTS:
        adopted, passed = read_module_meta(RunDir(runs["train"]), i), read_module_meta(RunDir(runs["pass"]), i)
        assert adopted["heldout_on"] == "final trunk" and adopted["router_stats_on"] == ON_FINAL
        for d, v in adopted["heldout_loss"].items():
            assert v == pytest.approx(passed["heldout_loss"][d], abs=2e-3), d
    from tokenizers import Tokenizer

    run = runs["train"]
    ids = Tokenizer.from_file(str(run / "tokenizer.json")).encode(text_sample()).ids[:64]
    out = tmp_path / "m.gguf"
    assert assemble(run, out, quant="f32", top_k=2, progress=False)["merged_tensors"] == 0
    ref, _ = reference_logits(run, out, ids)
    assert rel_diff(llama_logits(out, ids, 64), ref) <= 1e-3


def test_train_experts_runs_both_syncs(trunk_only, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(trunk_only, run)
    s = train_experts(run, workers=1, job=JobOptions(OPTS), progress=False, in_process=True)
    assert s["syncs"] == 2 and len(s["jobs"]) == 2 * TINY_EXPERTS
    assert read_module_meta(RunDir(run), 0)["final"]
    assert all(read_module_meta(RunDir(run), i)["shared_merged"] for i in EXPERTS)


@pytest.mark.parametrize("args, says", [
    (("--shared", "attn", "--rounds", "2", "--ffn-rounds", "2"), "below R"),
    (("--shared", "attn", "--rounds", "1", "--ffn-rounds", "1"), "below R"),
    (("--shared", "attn", "--rounds", "3", "--ffn-rounds", "-1"), "--ffn-rounds -1"),
])
def test_bad_ffn_rounds_one_clear_line(trunk_only, tmp_path, args, says):
    run = tmp_path / "run"
    shutil.copytree(trunk_only, run)
    code, out = _cli("train-expert", run, "--expert", "1", *args, "--no-progress")
    assert code == 1 and says in out and len(out.splitlines()) == 1, out
    assert not RunDir(run).module_meta(1).exists()
    assert json.loads((run / "run.json").read_text())  # the run is untouched
