"""The train verbs through the real CLI: results on one line, bad input as one `error:` line."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from mfgguf.cli.app import app
from mfgguf.run import RunDir, sha256_file
from tests.conftest import TINY_EXPERTS, copy_run


def _fails_cleanly(args, match: str):
    r = CliRunner().invoke(app, args)
    assert r.exit_code == 1, (r.exit_code, r.output)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and match in lines[0], r.stderr
    assert "Traceback" not in r.output
    return lines[0]


def _snapshot(run):
    return {str(p.relative_to(run)): sha256_file(p) for p in sorted(run.rglob("*")) if p.is_file()}


@pytest.fixture
def run_copy(trained_run, tmp_path):
    return copy_run(trained_run, tmp_path / "run")


def test_expert_index_out_of_range(run_copy):
    before = _snapshot(run_copy)
    _fails_cleanly(["train-expert", str(run_copy), "--expert", str(TINY_EXPERTS + 1)], "out of range")
    _fails_cleanly(["train-expert", str(run_copy), "--expert", "0"], "out of range")
    assert _snapshot(run_copy) == before


def test_missing_trunk(prepared_run, tmp_path):
    run = copy_run(prepared_run, tmp_path / "run")
    before = _snapshot(run)
    _fails_cleanly(["train-expert", str(run), "--expert", "1"], "mfgguf train-trunk")
    assert _snapshot(run) == before


def test_corrupted_checkpoint_then_restart(run_copy):
    rd = RunDir(run_copy)
    ck = rd.checkpoint_dir(1)
    ck.mkdir(parents=True)
    (ck / "state.safetensors").write_bytes(b"not a safetensors file")
    before = _snapshot(run_copy)
    _fails_cleanly(["train-expert", str(run_copy), "--expert", "1"], "--restart")
    assert _snapshot(run_copy) == before  # the module and the bad checkpoint are both untouched
    r = CliRunner().invoke(app, ["train-expert", str(run_copy), "--expert", "1", "--tokens", "2048",
                                 "--restart", "--no-progress"])
    assert r.exit_code == 0, r.output
    assert r.stdout.startswith("expert_001: final loss") and "validation loss" in r.stdout
    assert json.loads(rd.module_meta(1).read_text())["tokens_seen"] == 2048
    assert not ck.exists()


def test_incompatible_run_version(run_copy):
    info = json.loads((run_copy / "run.json").read_text())
    (run_copy / "run.json").write_text(json.dumps({**info, "version": 999}))
    before = _snapshot(run_copy)
    _fails_cleanly(["train-trunk", str(run_copy), "--preset", "tiny"], "incompatible")
    _fails_cleanly(["train-expert", str(run_copy), "--expert", "1"], "incompatible")
    assert _snapshot(run_copy) == before


def test_bad_options(run_copy):
    before = _snapshot(run_copy)
    _fails_cleanly(["train-trunk", str(run_copy), "--preset", "huge"], "unknown preset")
    _fails_cleanly(["train-trunk", str(run_copy), "--preset", "tiny", "--precision", "fp8"], "unknown precision")
    _fails_cleanly(["train-trunk", str(run_copy / "nope")], "not a RUN directory")
    assert _snapshot(run_copy) == before


def test_train_trunk_cli(run_copy):
    r = CliRunner().invoke(app, ["train-trunk", str(run_copy), "--preset", "tiny", "--tokens", "1024",
                                 "--batch-size", "4", "--lr", "1e-3", "--precision", "fp32", "--no-progress"])
    assert r.exit_code == 0, r.output
    assert r.stdout.startswith("trunk: final loss") and "trunk.safetensors" in r.stdout
    meta = json.loads(RunDir(run_copy).module_meta(0).read_text())
    assert meta["train"]["batch_size"] == 4 and meta["train"]["lr"] == 1e-3 and meta["precision"] == "fp32"
