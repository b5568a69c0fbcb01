"""`mfgguf train-experts`: many expert jobs at once, locally and on a real local Ray cluster.

A real tiny run with four experts (`--partition random` on the built-in corpus). Every scheduled
result is compared byte for byte with the same experts trained one after another by
`train_expert` (the module files' sha256), with the same torch thread count per job.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from mfgguf.cli.app import app
from mfgguf.errors import MfggufError
from mfgguf.run import RunDir, read_module_meta, router_stats_current
from mfgguf.options import JobOptions, TrainOptions, parse_experts
from mfgguf.train.fanout.schedule import plan_workers, train_experts
from tests.conftest import TINY_CHARS, copy_run

N = 4
TOKENS = 10_240  # 20 steps of the tiny preset (512 tokens each): a checkpoint at 10, so a kill can resume
JOB = JobOptions(TrainOptions(tokens=TOKENS))
ROUNDS_JOB = JobOptions(TrainOptions(tokens=TOKENS, shared="norms", rounds=2))


@pytest.fixture(scope="module")
def four_run(tmp_path_factory) -> Path:
    """Prepared (4 random shards) with a trained tiny trunk, no experts."""
    from mfgguf.data.prepare import prepare
    from mfgguf.train.whole.trunk import train_trunk

    root = tmp_path_factory.mktemp("four") / "run"
    prepare(["builtin"], root, n_experts=N, partition="random", vocab_size=512, max_chars_per_domain=TINY_CHARS // 2, seed=0)
    train_trunk(root, preset="tiny", options=TrainOptions(tokens=10_240), progress=False)
    return root


@pytest.fixture(scope="module")
def sequential(four_run, tmp_path_factory) -> dict[int, str]:
    """sha256 of each expert module trained one after another, one torch thread (as a scheduled job gets)."""
    run = copy_run(four_run, tmp_path_factory.mktemp("seq") / "run")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for i in range(1, N + 1):
        subprocess.run([sys.executable, "-m", "mfgguf", "train-expert", str(run), "--expert", str(i), "--tokens",
                        str(TOKENS), "--no-progress"], check=True, env=env, capture_output=True)
    return _hashes(run)


def _hashes(run: Path) -> dict[int, str]:
    rd = RunDir(run)
    return {i: read_module_meta(rd, i)["sha256"] for i in range(1, N + 1) if rd.module_meta(i).is_file()}


def test_parse_experts():
    assert parse_experts("1-3,5", 8) == [1, 2, 3, 5]
    assert parse_experts(None, 3) == [1, 2, 3]
    with pytest.raises(MfggufError, match="out of range"):
        parse_experts("2-9", 4)
    with pytest.raises(MfggufError, match="ranges such as"):
        parse_experts("a-b", 4)


def test_cli_bad_selection_is_one_line(four_run, tmp_path):
    run = copy_run(four_run, tmp_path / "run")
    for args, want in ((["--experts", "2-9"], "out of range"), (["--workers", "0"], "--workers"),
                       (["--ray", "auto", "--transfer", "nfs"], "--transfer")):
        r = CliRunner().invoke(app, ["train-experts", str(run), *args, "--no-progress"])
        assert r.exit_code == 1 and want in r.output and "Traceback" not in r.output, r.output
    assert not list((run / "modules").glob("expert_*"))


def test_local_two_workers_equal_sequential(four_run, sequential, tmp_path):
    run = copy_run(four_run, tmp_path / "run")
    s = train_experts(run, workers=2, job=JOB, progress=False)
    assert _hashes(run) == sequential
    assert sorted(j["expert"] for j in s["jobs"]) == [1, 2, 3, 4] and not s["failed"]
    assert all(j["peak_rss_mb"] > 50 for j in s["jobs"])
    assert json.loads((run / "logs" / "train-experts.json").read_text())["jobs"]
    assert router_stats_current(RunDir(run))  # every expert done: the router's pooled statistics too
    again = train_experts(run, workers=2, job=JOB, progress=False)  # nothing missing: nothing runs
    assert again["jobs"] == []


def test_local_killed_job_is_retried_and_identical(four_run, sequential, tmp_path):
    run = copy_run(four_run, tmp_path / "run")
    proc = subprocess.Popen([sys.executable, "-m", "mfgguf", "train-experts", str(run), "--workers", "2",
                             "--tokens", str(TOKENS), "--experts", "1-2", "--no-progress"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    pid = _wait_for_checkpoint(run, 1)
    os.kill(pid, signal.SIGKILL)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out
    s = json.loads((run / "logs" / "train-experts.json").read_text())
    assert {j["expert"]: j["retries"] for j in s["jobs"]}[1] == 1
    assert _hashes(run) == {i: sequential[i] for i in (1, 2)}


def test_bad_input_fails_alone(four_run, tmp_path):
    run = copy_run(four_run, tmp_path / "run")
    shard = RunDir(run).shard(2)
    np.save(shard, np.full(4096, 60_000, dtype=np.uint16))  # token ids beyond the vocabulary
    r = CliRunner().invoke(app, ["train-experts", str(run), "--workers", "2", "--tokens", str(TOKENS), "--no-progress"])
    assert r.exit_code == 1
    assert "expert_002" in r.output and "Traceback" not in r.output
    assert sorted(_hashes(run)) == [1, 3, 4]


def test_in_process_equals_sequential_and_fails_alone(four_run, sequential, tmp_path, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # one job at a time, one thread: as the sequential children ran
    run = copy_run(four_run, tmp_path / "run")
    np.save(RunDir(run).shard(3), np.full(4096, 60_000, dtype=np.uint16))  # token ids beyond the vocabulary
    r = CliRunner().invoke(app, ["train-experts", str(run), "--in-process", "--tokens", str(TOKENS), "--no-progress"])
    assert r.exit_code == 1 and "expert_003" in r.output and "Traceback" not in r.output, r.output
    s = json.loads((run / "logs" / "train-experts.json").read_text())
    assert s["backend"].startswith("this process") and [j["expert"] for j in s["jobs"]] == [1, 2, 3, 4]
    assert _hashes(run) == {i: sequential[i] for i in (1, 2, 4)}  # the same bytes as a child process writes


@pytest.fixture(scope="module")
def two_rounds(four_run, tmp_path_factory) -> tuple[Path, dict]:
    """Two sync rounds of `--shared norms` experts through 2 local workers: (RUN, summary)."""
    run = copy_run(four_run, tmp_path_factory.mktemp("rounds") / "run")
    return run, train_experts(run, workers=2, job=ROUNDS_JOB, progress=False)


def test_rounds_run_every_round_and_sync(two_rounds):
    run, s = two_rounds
    assert s["syncs"] == 2 and len(s["jobs"]) == 2 * N
    trunk = read_module_meta(RunDir(run), 0)
    assert trunk["final"] and trunk["syncs"] == 2
    assert all(read_module_meta(RunDir(run), i).get("shared_merged") for i in range(1, N + 1))
    assert router_stats_current(RunDir(run))  # pooled by the final sync's statistics passes
    r = CliRunner().invoke(app, ["train-experts", str(run), "--no-progress"])
    assert r.exit_code == 0 and "nothing to do" in r.output


def test_in_process_rounds_equal_processes(four_run, two_rounds, tmp_path, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # the two-worker run's children had one thread each
    run = copy_run(four_run, tmp_path / "run")
    s = train_experts(run, workers=1, job=ROUNDS_JOB, progress=False, in_process=True)
    assert s["syncs"] == 2 and s["backend"].startswith("this process")
    assert _hashes(run) == _hashes(two_rounds[0])
    assert read_module_meta(RunDir(run), 0)["sha256"] == read_module_meta(RunDir(two_rounds[0]), 0)["sha256"]


# ---- Ray: a real local cluster of two CPUs ------------------------------------------------------


@pytest.fixture(scope="module")
def ray_cluster():
    ray = pytest.importorskip("ray")
    os.environ["RAY_worker_niceness"] = "0"  # as `--ray local` does: jobs at the tests' own priority
    ray.init(num_cpus=2, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    yield ray
    ray.shutdown()


def test_ray_copy_mode_equals_sequential(ray_cluster, four_run, sequential, tmp_path):
    run = copy_run(four_run, tmp_path / "run")
    s = train_experts(run, ray="auto", transfer="copy", job=JOB, progress=False)
    assert _hashes(run) == sequential
    assert s["backend"].startswith("Ray") and not s["failed"]
    assert not (RunDir(run).root / "checkpoints" / "expert_001").exists()


def test_ray_copy_mode_rounds_equal_local(ray_cluster, four_run, two_rounds, tmp_path):
    """Between rounds the checkpoint travels to the worker and back: the result is the local one."""
    run = copy_run(four_run, tmp_path / "run")
    s = train_experts(run, ray="auto", transfer="copy", job=ROUNDS_JOB, progress=False)
    assert s["syncs"] == 2
    assert _hashes(run) == _hashes(two_rounds[0])
    assert read_module_meta(RunDir(run), 0)["sha256"] == read_module_meta(RunDir(two_rounds[0]), 0)["sha256"]


def test_ray_killed_worker_is_retried(ray_cluster, four_run, sequential, tmp_path):
    import threading

    run = copy_run(four_run, tmp_path / "run")
    killer = threading.Thread(target=lambda: os.kill(_wait_for_checkpoint(run, 1), signal.SIGKILL), daemon=True)
    killer.start()
    s = train_experts(run, ray="auto", transfer="shared", job=JOB, experts="1-2", progress=False)
    killer.join(timeout=5)
    assert {j["expert"]: j["retries"] for j in s["jobs"]}[1] >= 1
    assert _hashes(run) == {i: sequential[i] for i in (1, 2)}


def test_ray_bad_input_fails_alone(ray_cluster, four_run, tmp_path):
    run = copy_run(four_run, tmp_path / "run")
    np.save(RunDir(run).shard(3), np.full(4096, 60_000, dtype=np.uint16))
    with pytest.raises(MfggufError, match="expert_003"):
        train_experts(run, ray="auto", transfer="copy", job=JOB, progress=False)
    assert sorted(_hashes(run)) == [1, 2, 4]


def _wait_for_checkpoint(run: Path, i: int, timeout: float = 240) -> int:
    """The pid training expert i, once it has written a checkpoint (so a restart resumes from it)."""
    rd = RunDir(run)
    status = rd.root / "logs" / f"expert_{i:03d}.status.json"
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if (rd.checkpoint_dir(i) / "state.json").is_file() and status.is_file():
            try:
                return int(json.loads(status.read_text())["pid"])
            except (ValueError, KeyError):
                pass
        time.sleep(0.05)
    raise AssertionError(f"expert {i} wrote no checkpoint in {timeout} s")


def test_omp_num_threads_caps_the_local_plan(monkeypatch):
    """A caller's OMP_NUM_THREADS holds for the jobs train-experts starts (it overrode it with every core)."""
    cores = len(os.sched_getaffinity(0))
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert plan_workers("small", 1) == (1, cores)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert plan_workers("small", 1) == (1, 1) and plan_workers("small") == (1, 1)
    monkeypatch.setenv("OMP_NUM_THREADS", "")  # empty or not a number: no cap
    assert plan_workers("small", 1) == (1, cores)
