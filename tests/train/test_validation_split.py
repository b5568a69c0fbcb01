"""The protocol every figure rests on: choices read the validation split, reports the test split.

A real tiny run from scratch has its test split replaced by a decoy that fails whatever opens it;
every stage that makes a choice on data (training curves and final scores, router statistics,
calibrate, tune-router) must still run. A RUN prepared before the validation split existed
keeps working, with its one held-out split in both roles.
"""

from __future__ import annotations

import shutil

import numpy as np
from typer.testing import CliRunner

from mfgguf.cli.app import app
from mfgguf.data.partition import draw_split, split_three
from mfgguf.run import RunDir, read_module_meta
from tests.conftest import copy_run

runner = CliRunner()


def cli(*args):
    r = runner.invoke(app, [str(a) for a in args])
    assert r.exit_code == 0, r.output
    return r


def decoy(rd: RunDir) -> None:
    """The test split's files replaced by bytes no reader accepts."""
    for f in rd.test_dir.iterdir():
        f.write_bytes(b"the test split: no choice may read it")


def test_three_splits_are_disjoint_and_the_test_split_is_the_old_held_out_one():
    domains = ["a"] * 40 + ["b"] * 7 + ["c"] * 2 + ["d"]
    train, valid, test = split_three(domains, 0.1, 0.1, seed=3)
    assert np.array_equal(test, draw_split(domains, 0.1, seed=3)[1])  # RUNs keep their test documents
    assert not set(train) & set(valid) and not set(train) & set(test) and not set(valid) & set(test)
    assert sorted([*train, *valid, *test]) == list(range(len(domains)))
    got = {d: [domains[i] for i in valid].count(d) for d in "abcd"}
    assert got == {"a": 4, "b": 1, "c": 0, "d": 0}  # c keeps its last training document, d has one document
    assert {domains[i] for i in train} == set("abcd")


def test_no_choice_making_stage_opens_the_test_split(prepared_run, tmp_path):
    run = copy_run(prepared_run, tmp_path / "run")
    rd = RunDir(run)
    info = rd.info()
    assert set(info["valid"]) == set(info["test"]) == set(info["domains"])
    for d in info["domains"]:  # validation documents are neither test nor training documents
        assert rd.valid_text(d).read_text() not in rd.test_text(d).read_text()
    decoy(rd)
    cli("train-trunk", run, "--preset", "tiny", "--tokens", 16384, "--no-progress")
    for i in (1, 2, 3):
        cli("train-expert", run, "--expert", i, "--tokens", 8192, "--no-progress")
    assert set(read_module_meta(rd, 1)["validation_loss"]) == set(info["domains"])  # scored on validation
    cli("router-stats", run, "--no-progress")
    gguf = tmp_path / "moe.gguf"
    cli("assemble", run, "-o", gguf, "--quant", "f32", "-q")
    cli("calibrate", gguf, "--run", run, "-o", tmp_path / "cal.gguf", "--top-k", "1,2",
        "--tokens", 128, "--ctx", 64, "--threads", 2, "--quiet")
    cli("tune-router", gguf, "--run", run, "-o", tmp_path / "tuned.gguf", "--tokens", 512, "--epochs", 1, "--ctx", 32,
        "--val-tokens", 256, "--no-progress")


def test_a_run_prepared_before_validation_uses_its_test_split_for_both(prepared_run, tmp_path):
    rd = RunDir(copy_run(prepared_run, tmp_path / "run"))
    assert rd.validation_dir == rd.valid_dir and rd.split_roles() == {"validation": "valid", "test": "test"}
    shutil.rmtree(rd.valid_dir)
    assert rd.validation_dir == rd.test_dir and rd.split_roles() == {"validation": "test", "test": "test"}
    assert rd.validation_tokens(64).keys() == rd.test_tokens(64).keys()
