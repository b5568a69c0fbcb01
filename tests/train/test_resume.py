"""Kill a real training process with SIGKILL after its first checkpoint, resume, and compare the
result bit for bit with an uninterrupted run (CPU)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from mfgguf.errors import MfggufError
from mfgguf.run import RunDir
from mfgguf.train.expert import train_expert
from tests.conftest import copy_run

TOKENS, CKPT_EVERY = 60_000, 5  # 117 tiny steps: the kill lands long before the end


def _kill_after_first_checkpoint(run: Path, expert: int) -> int:
    cmd = [sys.executable, "-c", "from mfgguf.cli.app import main; main()", "train-expert", str(run),
           "--expert", str(expert), "--tokens", str(TOKENS), "--ckpt-every", str(CKPT_EVERY), "--no-progress"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            cwd=Path(__file__).parents[2], env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])})
    state = RunDir(run).checkpoint_dir(expert) / "state.safetensors"
    deadline = time.monotonic() + 120
    try:
        while not state.exists():
            assert proc.poll() is None, f"training exited before its first checkpoint: {proc.stderr.read()!r}"
            assert time.monotonic() < deadline, "no checkpoint within 120 s"
            time.sleep(0.005)
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        rc = proc.wait()
    return rc


def test_sigkill_then_resume_is_bit_identical(trained_run, tmp_path):
    a = copy_run(trained_run, tmp_path / "a")
    b = copy_run(trained_run, tmp_path / "b")
    rda = RunDir(a)
    rda.module_file(1).unlink()  # so that a module file after the kill would mean the run finished
    assert _kill_after_first_checkpoint(a, 1) == -signal.SIGKILL
    assert not rda.module_file(1).exists(), "the process finished before it was killed"

    # A checkpoint made for another token budget is refused (and left alone), with the way out.
    with pytest.raises(MfggufError, match="different train.*--restart"):
        train_expert(a, 1, tokens=TOKENS // 2, ckpt_every=CKPT_EVERY, progress=False)
    assert (rda.checkpoint_dir(1) / "state.safetensors").is_file()

    resumed = train_expert(a, 1, tokens=TOKENS, ckpt_every=CKPT_EVERY, progress=False)
    whole = train_expert(b, 1, tokens=TOKENS, ckpt_every=CKPT_EVERY, progress=False)
    assert resumed["resumed_from_step"] >= CKPT_EVERY and whole["resumed_from_step"] == 0
    assert resumed["history"] == whole["history"]
    ta, tb = load_file(rda.module_file(1)), load_file(RunDir(b).module_file(1))
    assert ta.keys() == tb.keys()
    for k in ta:
        assert torch.equal(ta[k], tb[k]), k
    # (file sha256s may differ: safetensors writes header metadata in hash-map order)
    assert not rda.checkpoint_dir(1).exists()  # removed once the module is written
