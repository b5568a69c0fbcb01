"""Shared fixtures: one real tiny pipeline per test session, built from the built-in corpus.

Each fixture is a stage of the pipeline run for real (real text, real tokenizer, real training,
real GGUF). Tests that modify a RUN copy it first with `copy_run`.
"""

from __future__ import annotations

import importlib
import shutil
import sys
from pathlib import Path

import pytest

TINY_EXPERTS = 3  # one per built-in domain with partition=label
TINY_CHARS = 400_000  # per domain: enough text for a 512-token BPE and a few thousand training steps


@pytest.fixture(scope="session")
def prepared_run(tmp_path_factory) -> Path:
    """A RUN directory after `prepare` on the built-in corpus (3 domains, 3 experts, vocab 512)."""
    from mfgguf.data.prepare import prepare

    root = tmp_path_factory.mktemp("prepared") / "run"
    prepare(["builtin"], root, n_experts=TINY_EXPERTS, partition="label", vocab_size=512,
            max_chars_per_domain=TINY_CHARS, seed=0)
    return root


@pytest.fixture(scope="session")
def trained_run(prepared_run, tmp_path_factory) -> Path:
    """`prepared_run` copied, with a trained `tiny` trunk and all experts trained."""
    from mfgguf.train.experts.expert import train_expert
    from mfgguf.train.experts.pooled import pool_router_stats
    from mfgguf.train.whole.trunk import train_trunk

    root = tmp_path_factory.mktemp("trained") / "run"
    shutil.copytree(prepared_run, root)
    train_trunk(root, preset="tiny", progress=False)
    for i in range(1, TINY_EXPERTS + 1):
        train_expert(root, i, progress=False)
    pool_router_stats(root, progress=False)  # `mfgguf router-stats`, as train-experts does at its end
    return root


@pytest.fixture(scope="module")
def f32_moe(trained_run, tmp_path_factory) -> tuple[Path, Path]:
    """(RUN copy, its f32 granitemoe GGUF with top-1) from the session's really trained tiny run; one per test
    module, so a module may change both."""
    from mfgguf.converters.assemble import assemble

    root = copy_run(trained_run, tmp_path_factory.mktemp("moe") / "run")
    gguf = root.parent / "model.gguf"
    assemble(root, gguf, quant="f32", progress=False)
    return root, gguf


def copy_run(src: Path, dst: Path) -> Path:
    """Copy a RUN directory (without checkpoints) so a test may modify it."""
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("checkpoints"))
    return dst


def sigkill_at_checkpoint(code: str, args: list[str], state: Path) -> int:
    """Run `python -c code args...` from the repository (this checkout's mfgguf) and SIGKILL it once the
    checkpoint file `state` exists; the exit status (-SIGKILL unless it ended first)."""
    import os
    import signal
    import subprocess
    import sys
    import time

    root = Path(__file__).parents[1]
    proc = subprocess.Popen([sys.executable, "-c", code, *args], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            cwd=root, env={**os.environ, "PYTHONPATH": str(root)})
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


def script_module(name: str):
    """A module of scripts/ (house, gen_cli_docs...), imported without leaving scripts/ on sys.path."""
    scripts = str(Path(__file__).resolve().parents[1] / "scripts")
    sys.path.insert(0, scripts)
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(scripts)
