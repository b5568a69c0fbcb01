"""`train-expert` for each expert, then `assemble`: assembly runs the router-stats pass itself where it can."""

from __future__ import annotations

import json
import re

import pytest
from typer.testing import CliRunner

from mfgguf.cli.app import app
from mfgguf.converters.assemble import assemble
from mfgguf.errors import MfggufError
from mfgguf.run import RunDir, router_stats_current

from tests.conftest import copy_run


def _without_pooled(trained_run, dst):
    """The run as `train-trunk` + `train-expert` for each expert leave it: no pooled router statistics."""
    run = copy_run(trained_run, dst)
    rd = RunDir(run)
    rd.router_stats.unlink()
    rd.router_stats_meta.unlink()
    man = json.loads(rd.manifest.read_text())
    man.pop("router_stats")
    rd.manifest.write_text(json.dumps(man))
    return run


def test_assemble_computes_missing_router_stats(trained_run, tmp_path, capsys):
    run = _without_pooled(trained_run, tmp_path / "run")
    assert not router_stats_current(RunDir(run))
    out = tmp_path / "m.gguf"
    r = assemble(run, out, quant="f32", progress=True)
    err = capsys.readouterr().err
    lines = [l for l in err.splitlines() if l.startswith("assemble:")]
    assert lines == [f"assemble: the pooled router statistics are missing; computing them first"
                     f" (`mfgguf router-stats {run}`)"], err
    assert "router statistics" in err.replace(lines[0], "")  # the pass's own progress bar
    assert r["router"] == "ridge" and r["experts"] == [1, 2, 3] and router_stats_current(RunDir(run))
    # the same statistics `mfgguf router-stats` computed for the fixture, so the very same file
    ref = tmp_path / "ref.gguf"
    assemble(trained_run, ref, quant="f32", progress=False)
    assert out.read_bytes() == ref.read_bytes()
    # current now: a second assembly runs no pass
    assemble(run, tmp_path / "again.gguf", quant="f32", progress=False)
    assert "assemble:" not in capsys.readouterr().err


@pytest.mark.parametrize("absent", ["shard", "expert"])
def test_missing_router_stats_stay_an_error_where_the_pass_cannot_run(trained_run, tmp_path, absent):
    run = _without_pooled(trained_run, tmp_path / "run")
    rd = RunDir(run)
    if absent == "shard":  # a shard of an expert the assembly takes
        rd.shard(2).unlink()
        why, take = "shard 2 (data/shard_002.npy) is absent", [1, 2]
        pattern = "no pooled router statistics.*`mfgguf router-stats .*" + re.escape(why)
    else:  # every expert is asked for, one is not trained here: the plan names it before any pass
        rd.module_file(3).unlink()
        rd.module_meta(3).unlink()
        why, take = "train it with `mfgguf train-expert RUN --expert 3`", None
        pattern = "module expert_003 is missing.*" + re.escape(why)
    out = tmp_path / "m.gguf"
    with pytest.raises(MfggufError, match=pattern):
        assemble(run, out, quant="f32", experts=take, progress=False)
    r = CliRunner().invoke(app, ["assemble", str(run), "-o", str(out), "-q", *(["--experts", "1,2"] if take else [])])
    lines = r.output.strip().splitlines()
    assert r.exit_code == 1 and len(lines) == 1 and lines[0].startswith("error: ") and why in lines[0], r.output
    assert not out.exists() and not rd.router_stats.exists()


def test_a_subset_assembles_while_other_experts_are_untrained(trained_run, tmp_path, capsys):
    """`--experts 1,2` with expert 3 not trained here: the pass pools over the two taken, and the file has them."""
    run = _without_pooled(trained_run, tmp_path / "run")
    rd = RunDir(run)
    rd.module_file(3).unlink()
    rd.module_meta(3).unlink()
    r = assemble(run, tmp_path / "m.gguf", quant="f32", experts=[1, 2], progress=False)
    assert r["experts"] == [1, 2] and "--experts 1,2" in capsys.readouterr().err
    assert set(json.loads(rd.router_stats_meta.read_text())["experts"]) == {"expert_001", "expert_002"}
