"""Warmup-Stable-Decay schedules: the LR's shape, the trunk's branch point (exact, and exact after a
SIGKILL), and wsd experts that continue from it at its LR."""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from mfgguf.config import ModelConfig, TrainConfig
from mfgguf.errors import MfggufError
from mfgguf.model import trunk_model
from mfgguf.options import JobOptions, TrainOptions
from mfgguf.run import ModuleMeta, RunDir, read_module_meta
from mfgguf.train.experts import shared as sh
from mfgguf.train.experts.config import at_branch_lr
from mfgguf.train.whole.branch import branch_files, branch_names, read_branch, start_from_branch
from mfgguf.train.engine.driver import check_schedule, cooldown_start, lr_at, schedule_steps
from mfgguf.train.experts.expert import build_expert_model, expert_params, train_expert
from mfgguf.train.engine.loop import load_tokens, run_loop
from mfgguf.train.engine.records import Checkpoints, Drive, StepSetup
from mfgguf.train.whole.trunk import train_trunk
from tests.conftest import copy_run

WSD = TrainConfig(lr=1e-3, warmup_frac=0.1, min_lr_frac=0.1, schedule="wsd", cooldown=0.2)
TOKENS = 20_000  # tiny: 39 steps, the cooldown's last 8


def test_wsd_lr_shape():
    steps = 100
    lrs = [lr_at(s, steps, WSD) for s in range(steps)]
    assert lrs[:10] == pytest.approx([1e-3 * (s + 1) / 10 for s in range(10)])  # linear warm-up
    assert cooldown_start(steps, WSD) == 80 and all(v == 1e-3 for v in lrs[10:80])  # stable at the peak
    cool = lrs[80:]
    assert cool[0] < 1e-3 and all(a > b for a, b in zip(cool, cool[1:]))  # every cooldown step lowers it
    assert lrs[84] == pytest.approx(1e-3 * (0.1 + 0.9 * (1 - math.sqrt(5 / 20))))  # 1-sqrt, not linear
    assert lrs[-1] == pytest.approx(1e-4)  # the last step reaches lr * min_lr_frac
    assert lr_at(0, steps, replace(WSD, warmup_frac=0.0)) == 1e-3  # no warm-up: the first step at the peak
    assert cooldown_start(steps, replace(WSD, cooldown=0.0)) == 100 and lr_at(99, steps, replace(WSD, cooldown=0.0)) == 1e-3
    cos = replace(WSD, schedule="cosine")  # cosine: unchanged, and no branch point
    assert cooldown_start(steps, cos) is None
    assert [lr_at(s, steps, cos) for s in (0, 9, 55)] == pytest.approx([1e-4, 1e-3, 1e-3 * (0.1 + 0.9 * 0.5)])


def test_bad_schedules_are_refused():
    with pytest.raises(MfggufError, match="unknown --schedule 'step'"):
        check_schedule(replace(WSD, schedule="step"))
    for cooldown, warm in ((1.5, 0.0), (-0.1, 0.0), (0.96, 0.05)):
        with pytest.raises(MfggufError, match="--cooldown"):
            check_schedule(replace(WSD, cooldown=cooldown, warmup_frac=warm))
    check_schedule(replace(WSD, cooldown=0.95, warmup_frac=0.05))


def test_cli_flags(prepared_run, tmp_path):
    import typer.main
    from typer.testing import CliRunner

    from mfgguf.cli.app import app

    group = typer.main.get_command(app)
    for verb in ("train-trunk", "train-expert", "train-experts"):
        opts = {o for p in group.commands[verb].params for o in p.opts}
        assert {"--schedule", "--cooldown"} <= opts, verb
    assert "--dense-schedules" in {o for p in group.commands["eval"].params for o in p.opts}
    o = TrainOptions(schedule="wsd", cooldown=0.1)
    assert o.argv() == ["--schedule", "wsd", "--cooldown", "0.1"]  # what train-experts passes each job
    assert JobOptions(o).argv() == o.argv() and o.train_config(WSD).cooldown == 0.1
    run = copy_run(prepared_run, tmp_path / "run")
    r = CliRunner().invoke(app, ["train-trunk", str(run), "--preset", "tiny", "--schedule", "step", "--no-progress"])
    assert r.exit_code == 1 and "unknown --schedule 'step'" in r.output and "Traceback" not in r.output


@pytest.fixture(scope="module")
def wsd_run(prepared_run, tmp_path_factory) -> Path:
    """A tiny wsd trunk with a seed FFN (fp32, so the reference below computes the same bits)."""
    run = copy_run(prepared_run, tmp_path_factory.mktemp("wsd") / "run")
    train_trunk(run, preset="tiny", options=TrainOptions(tokens=TOKENS, schedule="wsd", seed_expert=True, eval_every=0),
                progress=False, precision="fp32")
    return run


def test_branch_point_is_the_state_where_the_cooldown_begins(wsd_run, tmp_path):
    rd = RunDir(wsd_run)
    trunk = read_module_meta(rd, 0)
    branch = read_branch(rd, trunk)
    cfg, tc = ModelConfig.from_dict(trunk["config"]), TrainConfig(**trunk["train"])
    steps = schedule_steps(tc, cfg.ctx_len)
    start = cooldown_start(steps, tc)
    assert branch["step"] == branch["adam_step"] == trunk["branch"]["step"] == start == 31 and branch["lr"] == tc.lr
    assert trunk["cooldown_tokens"] == (steps - start) * tc.batch_size * cfg.ctx_len
    assert not (rd.checkpoint_dir(0)).exists()  # the checkpoint's copy went with the checkpoint

    # The same training stopped after `start` steps (its checkpoint), computed here from scratch.
    torch.manual_seed(tc.seed)
    model, route = trunk_model(cfg)
    model.reset_parameters(torch.Generator().manual_seed(tc.seed))
    named = {n: p for n, p in model.named_parameters() if p.requires_grad}
    run_loop(model, named, load_tokens(rd.train_tokens, "train"), tc, setup=StepSetup(torch.device("cpu"), "fp32", route),
             ckpt=Checkpoints(tmp_path / "ref", {}), drive=Drive(stream=0, progress=False, until=start))
    ref = load_file(tmp_path / "ref" / "state.safetensors")
    got = load_file(branch_files(rd)[0])
    assert {k for k in got if k.startswith("param.")} == {k for k in ref if k.startswith("param.")}
    for n, p in named.items():
        assert torch.equal(got[f"param.{n}"], ref[f"param.{n}"]), n
        for part in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(got[f"{part}.{n}"].reshape(-1), ref[f"{part}.{n}"]), (part, n)
        assert int(ref[f"step.{n}"]) == start
    cooled = load_file(rd.module_file(0))  # the trunk written for use alone went on through the cooldown
    assert not torch.equal(cooled["blk.0.attn_q.weight"], got["param.layers.0.attn_q.weight"])


def _kill(run: Path, when: str, tokens: int) -> int:
    cmd = [sys.executable, "-c", "from mfgguf.cli.app import main; main()", "train-trunk", str(run), "--preset", "tiny",
           "--tokens", str(tokens), "--ckpt-every", "5", "--eval-every", "0", "--schedule", "wsd", "--no-progress"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, cwd=Path(__file__).parents[3],
                            env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[3])})
    ck = RunDir(run).checkpoint_dir(0)
    mark = ck / ("state.safetensors" if when == "before" else "branch.safetensors")
    deadline = time.monotonic() + 300
    try:
        while not mark.exists():
            assert proc.poll() is None, f"training exited first: {proc.stderr.read()!r}"
            assert time.monotonic() < deadline, f"no {mark.name} within 300 s"
            time.sleep(0.005)
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        rc = proc.wait()
    return rc


@pytest.mark.parametrize("when", ["before", "after"])
def test_sigkill_then_resume_gives_the_same_branch_point_and_trunk(prepared_run, tmp_path, when):
    """Killed before the branch point (the resumed run writes it) or after it (the kept one is published)."""
    tokens = TOKENS  # 39 steps: a checkpoint every 5, the branch point at 31
    a, b = copy_run(prepared_run, tmp_path / "a"), copy_run(prepared_run, tmp_path / "b")
    assert _kill(a, when, tokens) == -signal.SIGKILL
    assert not RunDir(a).module_file(0).exists(), "the process finished before it was killed"
    opts = TrainOptions(tokens=tokens, ckpt_every=5, eval_every=0, schedule="wsd")
    resumed, whole = (train_trunk(r, preset="tiny", options=opts, progress=False) for r in (a, b))
    assert resumed["resumed_from_step"] >= 5 and whole["resumed_from_step"] == 0
    assert resumed["history"] == whole["history"]
    ta, tb = load_file(RunDir(a).module_file(0)), load_file(RunDir(b).module_file(0))
    assert ta.keys() == tb.keys() and all(torch.equal(ta[k], tb[k]) for k in ta)
    (sa, ja), (sb, jb) = branch_files(RunDir(a)), branch_files(RunDir(b))
    assert sa.read_bytes() == sb.read_bytes()  # weights, moments and header, byte for byte
    assert read_branch(RunDir(a), resumed)["step"] == 31


def test_expert_starts_from_the_branch_point_at_its_lr(wsd_run, tmp_path):
    run = copy_run(wsd_run, tmp_path / "run")
    rd = RunDir(run)
    trunk = read_module_meta(rd, 0)
    branch = read_branch(rd, trunk)
    cfg = ModelConfig.from_dict(trunk["config"])
    opts = TrainOptions(tokens=4096, schedule="wsd", shared="norms", eval_every=0, eval_tokens=1024)
    tc = at_branch_lr(opts.train_config(TrainConfig()), ModuleMeta.from_json(trunk), opts)
    assert tc.lr == branch["lr"] == 3e-3 and tc.warmup_frac == 0.0 and lr_at(0, 100, tc) == branch["lr"]
    given = replace(opts, lr=1e-3)
    assert at_branch_lr(given.train_config(TrainConfig()), ModuleMeta.from_json(trunk), given).lr == 1e-3  # --lr, when given, wins

    # The start: the seed FFN and the shared copies are the branch point's, with its AdamW moments;
    # the frozen trunk is the cooled-down one the MoE runs with.
    model = build_expert_model(rd, cfg, 1, torch.device("cpu"), bf16_trunk=False, init="auto",
                               trainable=sh.shared_names(cfg, "norms"))
    named = {**expert_params(model), **sh.shared_params(model, "norms")}
    names = branch_names(cfg, tc)
    assert len(names) == len(named) == 2 * 3 + 5  # 2 layers x gate/up/down + 2 x 2 norms + output_norm
    start = start_from_branch(branch, named, names)
    ref = load_file(branch["path"])
    for n in names:
        assert torch.equal(named[n].detach(), ref[f"param.{n}"]), n
        assert torch.equal(start[n]["exp_avg_sq"], ref[f"exp_avg_sq.{n}"]) and start[n]["step"] == branch["step"]
    cooled = load_file(rd.module_file(0))
    assert torch.equal(model.get_parameter("layers.0.attn_q.weight").detach(), cooled["blk.0.attn_q.weight"])

    meta = train_expert(run, 1, options=opts, progress=False)  # a real job records where it started, and at what LR
    assert meta["train"]["lr"] == branch["lr"] and meta["train"]["warmup_frac"] == 0.0
    assert meta["branch_start"]["step"] == branch["step"] and meta["branch_start"]["tensors"] == 11

    branch_files(rd)[0].unlink()  # a wsd trunk's experts never start silently from the cooled-down trunk instead
    with pytest.raises(MfggufError, match="branch point .* is missing"):
        train_expert(run, 2, options=opts, progress=False)
    assert train_expert(run, 2, options=replace(opts, schedule="cosine"), progress=False)["branch_start"] is None


def test_eval_counts_the_trunks_cooldown_and_names_each_baselines_schedule(wsd_run):
    from mfgguf.eval.baselines.scratch import pick_schedule
    from mfgguf.eval.training_flops import flops_section
    from mfgguf.flops import trunk_step_flops
    from mfgguf.eval.report import report_markdown
    from tests.eval.test_report import _report

    trunk = read_module_meta(RunDir(wsd_run), 0)
    f = flops_section({0: ModuleMeta.from_json(trunk)})
    t = f["modules"]["trunk"]
    assert t["tokens"] == trunk["tokens_seen"] == trunk["branch"]["tokens"] + trunk["cooldown_tokens"]
    assert t["cooldown_flops"] == trunk["cooldown_tokens"] * trunk_step_flops(trunk["config"]).total > 0
    assert f["total"] == t["flops"] == trunk["train_flops"]  # the cooldown is in the totals the baselines get

    loss = lambda v: ModuleMeta.from_json({"validation_loss_mean": v})  # noqa: E731
    assert pick_schedule({"cosine": loss(4.2), "wsd": loss(4.1)})[0] == "wsd"
    assert pick_schedule({"cosine": loss(4.0), "wsd": loss(4.1)})[0] == "cosine"
    r = _report()
    r["flops"]["modules"] = {"trunk": t}
    r["dense_schedules"] = {"dense, FLOP-matched": {"chosen": "wsd", "validation_loss": {"cosine": 4.2, "wsd": 4.1}}}
    md = report_markdown(r)
    assert "| dense, FLOP-matched | wsd | 4.2000 | 4.1000 |" in md
    assert f"cooldown after its branch point ({trunk['cooldown_tokens']:,} tokens" in md


def test_streamed_trunk_keeps_the_same_branch_point(prepared_run, tmp_path):
    """The layer-streamed trunk follows the same schedule and keeps the same branch point, within the
    rounding its different summation order gives (test_streamed.py explains the tolerance)."""
    opts = TrainOptions(tokens=8 * 64 * 6, adam_eps=1e-6, schedule="wsd", cooldown=0.5, eval_every=0, seed_expert=True)
    a, b = copy_run(prepared_run, tmp_path / "mem"), copy_run(prepared_run, tmp_path / "stream")
    ma = train_trunk(a, preset="tiny", options=opts, progress=False, precision="fp32")
    mb = train_trunk(b, preset="tiny", options=opts, progress=False, precision="fp32", stream=True, accum=1)
    assert ma["branch"] == mb["branch"] == {"step": 3, "tokens": 3 * 8 * 64, "lr": 3e-3}
    ba, bb = read_branch(RunDir(a), ma), read_branch(RunDir(b), mb)
    assert ba["adam_step"] == bb["adam_step"] == 3
    ta, tb = load_file(ba["path"]), load_file(bb["path"])
    assert ta.keys() == tb.keys() and len(ta) == 3 * len(load_file(RunDir(a).module_file(0)))
    for k in ta:
        torch.testing.assert_close(tb[k], ta[k], atol=1e-5 if k.startswith("param.") else 1e-7, rtol=1e-4, msg=k)
    assert not torch.equal(ta["exp_avg.layers.0.attn_q.weight"], torch.zeros_like(ta["exp_avg.layers.0.attn_q.weight"]))
