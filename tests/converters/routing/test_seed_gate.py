"""`assemble --seed-gate C`: plain experts with the untrained seed FFN routed as expert 0.

Real tiny training on the built-in corpus (a trunk with a seed FFN, plain experts), the granitemoe file
run by llama.cpp (llama-cpp-python) and checked against the PyTorch reference of the same file.
"""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGUFReader
from safetensors import safe_open
from typer.testing import CliRunner

from mfgguf.cli.app import app
from mfgguf.converters.assemble import assemble
from mfgguf.errors import MfggufError
from mfgguf.options import TrainOptions
from mfgguf.reference import gguf_provenance
from mfgguf.run import RunDir
from mfgguf.train.experts.expert import train_expert
from mfgguf.train.experts.pooled import pool_router_stats
from mfgguf.train.whole.trunk import train_trunk

from tests.conftest import TINY_EXPERTS, copy_run
from tests.converters import llama_logits, reference_logits, rel_diff, text_sample


@pytest.fixture(scope="module")
def gated_run(prepared_run, tmp_path_factory):
    """A trunk with a seed FFN and plain experts, each trained from the seed on its own domain."""
    root = copy_run(prepared_run, tmp_path_factory.mktemp("gated") / "run")
    train_trunk(root, preset="tiny", options=TrainOptions(tokens=20_000, seed_expert=True), progress=False)
    for i in range(1, TINY_EXPERTS + 1):
        train_expert(root, i, options=TrainOptions(tokens=4096), progress=False, precision="fp32")
    pool_router_stats(root, progress=False)
    return root


def _ids(run, n=64):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(run / "tokenizer.json")).encode(text_sample()).ids[:n]


def _tensors(path):
    return {t.name: np.array(t.data) for t in GGUFReader(str(path)).tensors}


def test_seed_is_slot_zero_and_its_row_is_the_gate_times_the_rows_sum(gated_run, tmp_path):
    out = tmp_path / "gated.gguf"
    r = assemble(gated_run, out, quant="f32", router="ridge", seed_gate=0.5, progress=False)
    assert r["top_k"] == 1 and r["seed_gate"] == 0.5  # plain experts trained as one: top-1 by default
    prov = gguf_provenance(out)
    assert prov["routed_seed"] and prov["arch"] == "granitemoe"
    t = _tensors(out)
    with safe_open(str(RunDir(gated_run).module_file(0)), "np") as f:
        assert np.array_equal(t["blk.0.ffn_up_exps.weight"][0], f.get_tensor("blk.0.ffn_up_seed.weight"))
    with safe_open(str(RunDir(gated_run).module_file(2)), "np") as f:
        assert np.array_equal(t["blk.0.ffn_up_exps.weight"][2], f.get_tensor("blk.0.ffn_up.weight"))
    plain = tmp_path / "plain.gguf"
    assemble(gated_run, plain, quant="f32", router="ridge", progress=False)
    for l in range(len(prov["router_rows"])):
        rows, W = prov["router_rows"][l], _tensors(plain)[f"blk.{l}.ffn_gate_inp.weight"]  # (N + 1, dim), (N, dim)
        assert np.array_equal(rows[1:], W)  # the experts' rows are the plain file's
        assert np.allclose(rows[0], 0.5 * W.astype(np.float64).sum(0), rtol=1e-5, atol=1e-7)
    ids = _ids(gated_run)
    ref, _ = reference_logits(gated_run, out, ids)  # the PyTorch reference of N + 1 routed experts
    got = llama_logits(out, ids, 64)
    assert rel_diff(got, ref) <= 1e-3, rel_diff(got, ref)
    # and the gate routes something: the file differs from the plain MoE's function
    assert rel_diff(got, llama_logits(plain, ids, 64)) > 1e-4
    # the folded layout folds the anchor into the seed's slot too: the same function as a `llama` file
    folded = tmp_path / "folded.gguf"
    assemble(gated_run, folded, quant="f32", router="ridge", layout="folded", seed_gate=0.5, progress=False)
    assert gguf_provenance(folded)["arch"] == "llama"
    assert rel_diff(llama_logits(folded, ids, 64), ref) <= 1e-3


def test_a_folded_layout_refuses_a_merged_anchor(gated_run, tmp_path):
    """Experts that trained the anchor (--shared all) have it merged; a folded layout would need it in the seed's
    slot, which is the trunk's: refused in one line, and the granitemoe file still assembles."""
    run = copy_run(gated_run, tmp_path / "run")
    train_expert(run, 1, options=TrainOptions(tokens=1024, shared="all"), progress=False, precision="fp32")
    pool_router_stats(run, progress=False)
    with pytest.raises(MfggufError, match="--merge none or --layout shared-expert"):
        assemble(run, tmp_path / "x.gguf", quant="f32", layout="folded", seed_gate=0.5, progress=False)
    assert not (tmp_path / "x.gguf").exists()
    assemble(run, tmp_path / "g.gguf", quant="f32", seed_gate=0.5, progress=False)


def test_the_gate_spans_the_plain_moe_and_the_trunk_alone(gated_run, tmp_path):
    """A gate far up sends the tokens to the seed (anchor + seed: the trunk alone), one far down keeps them with
    the experts (the plain MoE). Not every token: the rows' sum is a least-squares fit to 1, negative for a few
    tokens of some layers, where the ends swap."""
    ids = _ids(gated_run)
    files = {}
    for name, kw in {"trunk": dict(experts=[]), "plain": dict(router="ridge"), "high": dict(router="ridge", seed_gate=1e4),
                     "low": dict(router="ridge", seed_gate=-1e4)}.items():
        files[name] = llama_logits(assemble(gated_run, tmp_path / f"{name}.gguf", quant="f32", progress=False,
                                            **kw)["path"], ids, 64)
    apart = rel_diff(files["plain"], files["trunk"])
    assert apart > 1e-2  # the two ends differ: the checks below can fail
    assert rel_diff(files["high"], files["trunk"]) < 0.1 * apart, (rel_diff(files["high"], files["trunk"]), apart)
    assert rel_diff(files["low"], files["plain"]) < 0.1 * apart, (rel_diff(files["low"], files["plain"]), apart)


def test_bad_gates_are_one_line_and_write_nothing(gated_run, trained_run, tmp_path):
    for kw, match in ((dict(router="centroid"), "--router ridge"), (dict(experts=[]), "none is selected"),
                      (dict(seed_gate=float("nan")), "not a number")):
        with pytest.raises(MfggufError, match=match):
            assemble(gated_run, tmp_path / "x.gguf", quant="f32", progress=False, **{"seed_gate": 0.5, **kw})
    with pytest.raises(MfggufError, match="--seed-expert"):  # a trunk trained without a seed FFN
        assemble(trained_run, tmp_path / "x.gguf", quant="f32", seed_gate=0.5, progress=False)
    r = CliRunner().invoke(app, ["assemble", str(gated_run), "-o", str(tmp_path / "y.gguf"), "--quant", "f32",
                                 "--router", "centroid", "--seed-gate", "0.5", "-q"])
    assert r.exit_code == 1 and "--router ridge" in r.output and "Traceback" not in r.output
    assert not list(tmp_path.glob("*.gguf"))
    r = CliRunner().invoke(app, ["assemble", str(gated_run), "-o", str(tmp_path / "z.gguf"), "--quant", "f32",
                                 "--seed-gate", "0.5", "-q"])
    assert r.exit_code == 0 and "seed routed as expert 0 (gate 0.5)" in r.output, r.output
    r = CliRunner().invoke(app, ["extend", str(tmp_path / "z.gguf"), "--add", str(gated_run), "--experts", "1",
                                 "-o", str(tmp_path / "w.gguf")])
    assert r.exit_code == 1 and "a seed gate" in r.output and "Traceback" not in r.output, r.output
    assert not (tmp_path / "w.gguf").exists()


def test_eval_compares_seed_gates_on_validation(gated_run, tmp_path, monkeypatch):
    out = tmp_path / "eval"
    r = CliRunner().invoke(app, ["eval", str(gated_run), "--out", str(out), "--routers", "ridge", "--top-k", "1",
                                 "--seed-gates", "0.5,10000", "--baselines", "none", "--quants", "",
                                 "--max-tokens", "2048"])
    assert r.exit_code == 0, r.output
    import json

    rep = json.loads((out / "report.json").read_text())
    gated = ["moe ridge seed-gate 0.5 top-1", "moe ridge seed-gate 10000 top-1"]
    moes = ["moe ridge top-1", *gated]
    for name in gated:  # candidates like every MoE, scored on validation for the choice
        assert rep["models"][name]["seed_gate"] in (0.5, 10000) and name in rep["validation"]
    # test scores the one validation chose (of this router and top-k), and no other
    assert rep["best"] == min(moes, key=lambda k: rep["validation"][k]["ppl"])
    assert [k for k in moes if k in rep["results"]] == [rep["best"]]
    md = (out / "report.md").read_text()
    assert all(f"| {k} | {rep['validation'][k]['ppl']:.4f} | {'best' if k == rep['best'] else 'no'} |" in md for k in moes)
    # an eval run again (as a study resumed after a stop) reuses every measurement stored for the same files and
    # settings: nothing is scored again, and the report's figures are the same
    import mfgguf.eval.evaluate as evaluate_mod

    def scored_again(*a, **k):
        raise AssertionError("measured again")

    monkeypatch.setattr(evaluate_mod, "measure", scored_again)
    r = CliRunner().invoke(app, ["eval", str(gated_run), "--out", str(out), "--routers", "ridge", "--top-k", "1",
                                 "--seed-gates", "0.5,10000", "--baselines", "none", "--quants", "",
                                 "--max-tokens", "2048"])
    assert r.exit_code == 0, r.output
    again = json.loads((out / "report.json").read_text())
    assert again["results"] == rep["results"] and again["validation"] == rep["validation"]
    # other settings are measured anew (here: a smaller cap), so a stored figure never stands for another
    r = CliRunner().invoke(app, ["eval", str(gated_run), "--out", str(out), "--routers", "ridge", "--top-k", "1",
                                 "--baselines", "none", "--quants", "", "--max-tokens", "1024"])
    assert r.exit_code != 0 and "measured again" in repr(r.exception)
    bad = CliRunner().invoke(app, ["eval", str(gated_run), "--seed-gates", "half"])
    assert bad.exit_code == 1 and "--seed-gates" in bad.output and "Traceback" not in bad.output
