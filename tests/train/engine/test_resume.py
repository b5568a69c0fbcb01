"""Kill a real training process with SIGKILL after its first checkpoint, resume, and compare the
result bit for bit with an uninterrupted run (CPU)."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from mfgguf.errors import MfggufError
from mfgguf.options import TrainOptions
from mfgguf.run import RunDir
from mfgguf.train.experts.expert import train_expert
from mfgguf.train.whole.trunk import train_trunk
from tests.conftest import copy_run, sigkill_at_checkpoint

TOKENS, CKPT_EVERY, EVAL_EVERY = 60_000, 5, 4  # 117 tiny steps: the kill lands long before the end


def _kill_after_first_checkpoint(run: Path, index: int, extra: list[str]) -> int:
    verb = (["train-trunk", str(run), "--preset", "tiny", "--eval-every", str(EVAL_EVERY)] if index == 0
            else ["train-expert", str(run), "--expert", str(index)])
    args = [*verb, "--tokens", str(TOKENS), "--ckpt-every", str(CKPT_EVERY), "--no-progress", *extra]
    return sigkill_at_checkpoint("from mfgguf.cli.app import main; main()", args,
                                 RunDir(run).checkpoint_dir(index) / "state.safetensors")


# expert-tail-stats: the router statistics span every step (tailstats.py), so the kill lands while they gather;
# compiled: torch.compile's step (`--compile on`, what auto picks for long schedules) resumes as exactly
@pytest.mark.parametrize("index, shared, stats, compile", [(0, None, None, "off"), (1, None, None, "off"),
                                                           (1, "attn", None, "off"), (1, None, TOKENS, "off"),
                                                           (1, "attn", None, "on")],
                         ids=["trunk", "expert", "expert-shared-attn", "expert-tail-stats", "expert-shared-attn-compiled"])
def test_sigkill_then_resume_is_bit_identical(trained_run, tmp_path, index, shared, stats, compile):
    a = copy_run(trained_run, tmp_path / "a")
    b = copy_run(trained_run, tmp_path / "b")
    rda = RunDir(a)
    target = rda.module_file(index)
    target.rename(target.with_suffix(".old"))  # a module file after the kill would mean the run finished
    extra = ["--compile", compile] + (["--shared", shared] if shared else []) + (["--stats-tokens", str(stats)] if stats else [])
    assert _kill_after_first_checkpoint(a, index, extra) == -signal.SIGKILL
    assert not target.exists(), "the process finished before it was killed"
    if shared:  # the checkpoint holds the private trunk copies and their AdamW state
        ck = load_file(rda.checkpoint_dir(index) / "state.safetensors")
        assert {f"{k}.layers.1.attn_q.weight" for k in ("param", "exp_avg", "exp_avg_sq", "step")} <= ck.keys()
    if stats:  # the statistics gathered so far are in the checkpoint
        ck = load_file(rda.checkpoint_dir(index) / "state.safetensors")
        assert int(ck["tailstats.count"][0]) > 0 and ck["tailstats.sum.0"].abs().sum() > 0
    target.with_suffix(".old").rename(target)  # experts need their trunk back to resume

    def train(run, tokens=TOKENS):
        if index == 0:
            return train_trunk(run, preset="tiny", options=TrainOptions(tokens=tokens, ckpt_every=CKPT_EVERY,
                                                                          eval_every=EVAL_EVERY, compile=compile),
                               progress=False)
        return train_expert(run, index, options=TrainOptions(tokens=tokens, ckpt_every=CKPT_EVERY, shared=shared,
                                                             stats_tokens=stats, compile=compile), progress=False)

    # A checkpoint made for another token budget is refused (and left alone), with the way out.
    with pytest.raises(MfggufError, match="different train.*--restart"):
        train(a, TOKENS // 2)
    assert (rda.checkpoint_dir(index) / "state.safetensors").is_file()

    resumed, whole = train(a), train(b)
    assert resumed["resumed_from_step"] >= CKPT_EVERY and whole["resumed_from_step"] == 0
    assert resumed["compiled"] == whole["compiled"] == (compile == "on")
    assert resumed["history"] == whole["history"]
    # the held-out curve survives the checkpoint too: points from before the kill, identical values
    assert resumed["validation_history"] == whole["validation_history"]
    if index == 0:
        assert [h[0] for h in whole["validation_history"]][:3] == [4, 8, 12] and whole["validation_history"][-1][0] == 117
    ta, tb = load_file(rda.module_file(index)), load_file(RunDir(b).module_file(index))
    assert ta.keys() == tb.keys()
    assert sum(k.startswith("shared.") for k in ta) == (13 if shared else 0)  # tiny: 2 layers x 6 + output_norm
    for k in ta:
        assert torch.equal(ta[k], tb[k]), k
    # (file sha256s may differ: safetensors writes header metadata in hash-map order)
    assert not rda.checkpoint_dir(index).exists()  # removed once the module is written
    if index:
        assert resumed["router_stats_count"] == whole["router_stats_count"] == (stats or 4 * 4096) // 512 * 512
