"""The whole `train-experts` run on one machine: its progress and ETA, the disk it needs counted and checked before
anything trains, and SIGKILL at any moment followed by the same command giving the same bytes.

A real tiny run of three experts. The kills go through the real CLI in a process group of its own, so each
takes everything the command started, at three seeded moments: during expert 1's job (a seeded delay after
its first checkpoint), between jobs (the moment expert 2's record is written), and during a checkpoint save
of expert 3 (while its temporary file exists; where the save is too quick to catch, while the statistics
are pooled). Each kill must land before the command ends; the run then finishes with the same command, and
every expert module and the router's pooled statistics are compared by sha256 with an uninterrupted run's.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from mfgguf.cli.app import app
from mfgguf.config import get_preset
from mfgguf.errors import MfggufError
from mfgguf.options import JobOptions, TrainOptions
from mfgguf.run import ModuleMeta, RunDir, read_module_meta
from mfgguf.train.fanout.jobs import Job
from mfgguf.train.fanout.plan import RunPlan
from mfgguf.train.fanout.schedule import train_experts
from mfgguf.train.fanout.view import RunProgress
from tests.conftest import TINY_CHARS, copy_run

N = 3
TOKENS, CKPT_EVERY = 6_144, 3  # 12 tiny steps (512 tokens each), a checkpoint every 3
JOB = JobOptions(TrainOptions(tokens=TOKENS, ckpt_every=CKPT_EVERY))
ARGS = ["--in-process", "--tokens", str(TOKENS), "--ckpt-every", str(CKPT_EVERY), "--no-progress"]


@pytest.fixture(scope="module")
def three_run(tmp_path_factory) -> Path:
    """Prepared (3 label shards) with a trained tiny trunk, no experts."""
    from mfgguf.data.prepare import prepare
    from mfgguf.train.whole.trunk import train_trunk

    root = tmp_path_factory.mktemp("three") / "run"
    prepare(["builtin"], root, n_experts=N, partition="label", vocab_size=512, max_chars_per_domain=TINY_CHARS // 2,
            seed=0)
    train_trunk(root, preset="tiny", options=TrainOptions(tokens=10_240), progress=False)
    return root


def _size(root: Path) -> int:
    n = 0
    for d, _, files in os.walk(root):
        for f in files:
            with contextlib.suppress(FileNotFoundError):  # renamed or removed between the listing and the stat
                n += os.stat(os.path.join(d, f)).st_size
    return n


@pytest.fixture(scope="module")
def whole(three_run, tmp_path_factory) -> dict:
    """An uninterrupted in-process run, one thread (as the killed command runs), its progress lines caught (not a
    terminal: lines) and RUN's size sampled while it ran: {run, summary, log, peak (bytes added at most)}."""
    run = copy_run(three_run, tmp_path_factory.mktemp("whole") / "run")
    before, peak, stop = _size(run), [0], threading.Event()

    def sample():
        while not stop.is_set():
            peak[0] = max(peak[0], _size(run) - before)
            time.sleep(0.002)

    sampler, log = threading.Thread(target=sample), io.StringIO()
    omp = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"
    sampler.start()
    try:
        with contextlib.redirect_stderr(log):
            summary = train_experts(run, job=JOB, in_process=True, progress=True)
    finally:
        stop.set()
        sampler.join()
        os.environ.pop("OMP_NUM_THREADS") if omp is None else os.environ.update(OMP_NUM_THREADS=omp)
    return {"run": run, "summary": summary, "log": log.getvalue(), "peak": max(peak[0], _size(run) - before)}


# ---- progress and ETA ---------------------------------------------------------------------------


def test_progress_counts_the_whole_run():
    """3 experts x 2 rounds of 10 steps of 100 tokens: expert 1 finished round 1 and expert 2 had 3 steps in a
    checkpoint before this command; now expert 2 is done and expert 3 is 2 steps in, 4 s after the start."""
    p = get_preset("tiny")
    plan = RunPlan(experts=(1, 2, 3), rounds=2, first_round=1, steps=10, per_step=100,
                   todo=((2, 1), (3, 1), (1, 2), (2, 2), (3, 2)), cfg=p.model, tc=p.expert, trunk=ModuleMeta(),
                   at_step={(2, 1): 3, (3, 1): 0})
    assert plan.total_tokens == 3000 and plan.done_tokens == 500 + 300 and plan.total_jobs == 6
    prog = RunProgress(plan, time.perf_counter() - 4.0)
    prog.add([Job(2, 1, state="done"), Job(3, 1, state="running", status={"step": 2})])
    c = prog.counts()
    assert (c["jobs_done"], c["jobs"]) == (2, 6)
    assert c["tokens_done"] == 500 + 500 + 200  # expert 1 and 2 round 1, expert 3's two steps
    assert c["tokens_per_s"] == pytest.approx((200 + 200) / 4.0, rel=0.05)  # this command's: not the resumed 300
    assert c["eta_s"] == pytest.approx((3000 - 1200) / c["tokens_per_s"])
    assert prog.line().startswith("2/6 jobs (3 experts x 2 rounds) | 1.2k/3k tokens (40.0%) | 100 tok/s | ETA 18s")


def test_a_log_shows_the_whole_run(whole):
    lines = [l for l in whole["log"].splitlines() if l.startswith("train-experts: ") and "experts |" in l]
    done = [int(l.split("/")[0].removeprefix("train-experts: ")) for l in lines]  # a line as jobs end (two may end
    assert done == sorted(done) and done[-1] == N and len(done) >= 2, whole["log"]  # between two looks: one line)
    assert f"{N * TOKENS / 1000:.3g}k/{N * TOKENS / 1000:.3g}k tokens (100.0%)" in lines[-1] and "tok/s" in lines[-1]
    assert "ETA" in lines[0] and "ETA -" not in lines[0]  # a speed, so an ETA, once the first job is done
    prog = whole["summary"]["progress"]
    assert prog["tokens_done"] == prog["tokens"] == N * TOKENS and prog["jobs_done"] == N and prog["tokens_per_s"] > 0


# ---- the disk -----------------------------------------------------------------------------------


def test_estimate_covers_what_the_run_wrote(whole):
    """The estimate is at least the most RUN held at once while it ran (checkpoints included), and not far above."""
    need = whole["summary"]["disk"]["need_bytes"]
    assert whole["peak"] > N * RunDir(whole["run"]).module_file(1).stat().st_size  # the sampler saw the run write
    assert whole["peak"] <= need <= 3 * whole["peak"], (need, whole["peak"], whole["summary"]["disk"])


def test_a_run_that_cannot_fit_refuses_before_training(three_run, tmp_path):
    run = copy_run(three_run, tmp_path / "run")
    before = sorted(p.relative_to(run) for p in run.rglob("*"))
    r = CliRunner().invoke(app, ["train-experts", str(run), "--tokens", str(TOKENS), "--keep-free", "1e9",
                                 "--no-progress"])
    assert r.exit_code == 1, r.output
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: not enough disk for this run: it will hold up to"), r.stderr
    assert "free on" in lines[0] and "--keep-free asks to leave" in lines[0] and "nothing was trained" in lines[0]
    assert sorted(p.relative_to(run) for p in run.rglob("*")) == before  # not a checkpoint, log or module
    with pytest.raises(MfggufError, match="not enough disk"):
        train_experts(run, job=JOB, keep_free=10**18, progress=False)


def test_a_shard_shorter_than_a_context_refuses_before_training(three_run, tmp_path):
    """A shard with less than one context (as a cluster partition of many experts over little text makes) stops the
    command in one line before any job, not when its own job's turn comes."""
    import numpy as np

    run = copy_run(three_run, tmp_path / "run")
    rd = RunDir(run)
    short = np.load(rd.shard(2))[:40].copy()  # (40,) tokens: under tiny's context of 64 + 1
    np.save(rd.shard(2), short)
    before = sorted(p.relative_to(run) for p in run.rglob("*"))
    r = CliRunner().invoke(app, ["train-experts", str(run), *ARGS])
    assert r.exit_code == 1, r.output
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: expert shard(s) 2 (40 tokens) hold less than one context"), r.stderr
    assert "nothing was trained" in lines[0] and "--experts" in lines[0]
    assert sorted(p.relative_to(run) for p in run.rglob("*")) == before
    r = CliRunner().invoke(app, ["train-experts", str(run), *ARGS, "--experts", "1"])  # leaving it out trains the rest
    assert r.exit_code == 0, r.output
    assert rd.module_file(1).is_file() and not rd.module_file(2).is_file()


# ---- SIGKILL at any moment ----------------------------------------------------------------------


def _sha(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


def _hashes(run: Path) -> dict[str, str]:
    """sha256 of every expert module file (read back, and as its record says) and of the pooled statistics."""
    rd = RunDir(run)
    out = {}
    for i in range(1, N + 1):
        out[f"expert_{i}"] = _sha(rd.module_file(i))
        assert read_module_meta(rd, i)["sha256"] == out[f"expert_{i}"]
    out["router_stats"] = _sha(rd.modules / "router_stats.safetensors")
    return out


def _kill_when(run: Path, ready, delay: float) -> tuple[int, str]:
    """Start the command, SIGKILL its process group `delay` s after `ready(rd)` holds; (exit status, its output)."""
    proc = subprocess.Popen([sys.executable, "-m", "mfgguf", "train-experts", str(run), *ARGS],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    rd, deadline = RunDir(run), time.monotonic() + 120
    try:
        while not ready(rd) and proc.poll() is None:
            assert time.monotonic() < deadline, "the moment to kill never came"
            time.sleep(0.001)
        time.sleep(delay)
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    finally:
        out, _ = proc.communicate(timeout=60)
    return proc.returncode, out


def _in_save(i: int):
    """Expert i's checkpoint save is in flight (its temporary file exists), or its job is over (then: pooling)."""
    return lambda rd: any(rd.checkpoint_dir(i).glob(".state.safetensors.*")) or rd.module_meta(i).is_file()


def test_three_kills_then_the_same_command_is_bit_identical(three_run, whole, tmp_path):
    run = copy_run(three_run, tmp_path / "killed")
    rd, rng = RunDir(run), random.Random(0)
    moments = [("during expert 1", lambda rd: (rd.checkpoint_dir(1) / "state.safetensors").is_file(),
                rng.uniform(0.0, 0.05)),
               ("between jobs", lambda rd: rd.module_meta(2).is_file(), 0.0),
               ("in expert 3's save", _in_save(3), 0.0)]
    left = []
    for what, ready, delay in moments:
        rc, out = _kill_when(run, ready, delay)
        assert rc == -signal.SIGKILL, f"{what}: the command ended ({rc}) before the kill\n{out}"
        left.append(sorted(p.parent.name for p in rd.root.glob("checkpoints/*/state.safetensors")))
    assert any(left), left  # a kill left a job half done: the next command resumed it from its checkpoint

    done = subprocess.run([sys.executable, "-m", "mfgguf", "train-experts", str(run), *ARGS], capture_output=True,
                          text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert _hashes(run) == _hashes(whole["run"])
    # a kill between a module and its checkpoint's removal left that checkpoint: the next command dropped it
    assert not list(rd.root.glob("checkpoints/*/*"))
