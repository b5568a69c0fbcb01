"""An assembled model scored on the training side's measure (eval/reference_validation.py), on a real tiny run."""

from __future__ import annotations

import math

import pytest

from mfgguf.converters.assemble import assemble
from mfgguf.eval.reference_validation import reference_validation
from mfgguf.run import RunDir, read_module_meta
from tests.conftest import copy_run
from tests.train.test_validation_split import decoy


@pytest.fixture(scope="module")
def run_and_models(trained_run, tmp_path_factory):
    root = copy_run(trained_run, tmp_path_factory.mktemp("refval") / "run")
    trunk, moe = root.parent / "trunk.gguf", root.parent / "moe.gguf"
    assemble(root, trunk, quant="f32", experts=[], progress=False)
    assemble(root, moe, quant="f32", top_k=1, progress=False)
    return RunDir(root), trunk, moe


def test_the_trunk_alone_scores_what_its_record_says(run_and_models):
    rd, trunk, _ = run_and_models
    meta = read_module_meta(rd, 0)
    got = reference_validation(rd, trunk, int(meta["train"]["eval_tokens"]), precision=meta["precision"])
    assert got.keys() == meta["validation_loss"].keys()
    for d, v in meta["validation_loss"].items():  # the GGUF's f32 weights are the trunk's own: the same windows, same loss
        assert got[d] == pytest.approx(v, abs=2e-3), d


def test_the_moe_is_scored_on_validation_only(run_and_models):
    rd, trunk, moe = run_and_models
    decoy(rd)  # the test split now fails whatever opens it
    alone, routed = reference_validation(rd, trunk, 512), reference_validation(rd, moe, 512)
    assert routed.keys() == alone.keys() == set(rd.info()["domains"])
    assert all(math.isfinite(v) for v in routed.values())
    assert routed != alone  # the experts and the router are in the forward
    assert reference_validation(rd, moe, 512) == routed
