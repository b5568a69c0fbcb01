"""The writer: torch-free, nothing lost (SIGKILL, --force), bad modules -> one error line, inspect."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from safetensors.numpy import load_file
from typer.testing import CliRunner

from mfgguf.cli.app import app
from mfgguf.converters.assemble import assemble
from mfgguf.gguf.inspect import format_inspect, inspect_gguf
from mfgguf.errors import MfggufError
from mfgguf.run import RunDir, write_module

from . import ROOT, flip_byte, repool, synthetic_run


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    return synthetic_run(tmp_path_factory.mktemp("syn") / "run", preset="tiny", n_experts=3, vocab=400)


@pytest.fixture
def run_copy(run, tmp_path):
    return shutil.copytree(run, tmp_path / "run")


def _cli(*args):
    r = CliRunner().invoke(app, [str(a) for a in args])
    return r.exit_code, r.output


def test_assembler_never_imports_torch(run, tmp_path):
    code = f"""
import sys
from pathlib import Path
from mfgguf.converters.assemble import assemble
from mfgguf.gguf.inspect import inspect_gguf, format_inspect
for lay in ("shared-expert", "folded"):
    assemble(Path({str(run)!r}), Path({str(tmp_path)!r}) / (lay + ".gguf"), quant="q4_k", layout=lay, progress=True)
assemble(Path({str(run)!r}), Path({str(tmp_path)!r}) / "dense.gguf", experts=[], progress=False)
format_inspect(inspect_gguf(Path({str(tmp_path)!r}) / "shared-expert.gguf"))
assert "torch" not in sys.modules, "the assembler imported torch"
# VmHWM, not ru_maxrss: Linux carries the parent's (pytest's) high-water mark across fork+exec
print([l for l in open('/proc/self/status') if l.startswith('VmHWM')][0].split()[1])
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    assert int(r.stdout.split()[-1]) < 150_000  # KB: no torch (~220 MB) anywhere in the process


def test_cli_assemble_does_not_import_torch(run, tmp_path):
    code = (f"import sys; from mfgguf.cli.app import app; "
            f"app(['assemble', {str(run)!r}, '-o', {str(tmp_path / 'm.gguf')!r}, '-q'], standalone_mode=False); "
            "assert 'torch' not in sys.modules, sorted(m for m in sys.modules if m.startswith('mfgguf'))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stderr


def test_existing_output_needs_force(run, tmp_path):
    out = tmp_path / "m.gguf"
    out.write_bytes(b"old")
    code, text = _cli("assemble", run, "-o", out, "-q")
    assert code == 1 and text.strip().splitlines() == [f"error: {out} already exists; pass --force to overwrite it"]
    assert out.read_bytes() == b"old"
    code, text = _cli("assemble", run, "-o", out, "-q", "--force", "--quant", "q4_0", "--top-k", "2", "--experts", "3,1")
    assert code == 0, text
    info = inspect_gguf(out)
    assert info["provenance"]["mfgguf.experts"] == [3, 1] and info["top_k"] == 2 and oct(out.stat().st_mode)[-3:] != "600"
    assert not list(tmp_path.glob(".*.tmp"))


def _expert_tensors(run, i):
    return load_file(str(RunDir(run).module_file(i)))


def _rewrite_expert(run, i, change, refresh=True):
    """Expert i changed by `change`; with refresh, the pooled router statistics re-recorded for it (so that only
    the change itself is wrong)."""
    rd = RunDir(run)
    meta = json.loads(rd.module_meta(i).read_text())
    t = _expert_tensors(run, i)
    change(t, meta)
    keep = {k: meta[k] for k in ("kind", "preset", "config", "shard", "trunk_sha256", "router_stats_count")}
    write_module(rd, i, t, keep)
    if refresh:
        repool(run)


def _truncate(run):
    p = RunDir(run).module_file(2)
    os.truncate(p, p.stat().st_size - 100)


def _flip_byte(run):
    flip_byte(RunDir(run).module_file(2))


def _wrong_shape(run):
    def ch(t, meta):
        t["blk.1.ffn_up.weight"] = t["blk.1.ffn_up.weight"][:64]
    _rewrite_expert(run, 2, ch)


def _nan(run):
    def ch(t, meta):
        t["blk.1.ffn_down.weight"][3, 5] = np.nan
    _rewrite_expert(run, 3, ch)


def _inf(run):
    rd = RunDir(run)
    meta = json.loads(rd.module_meta(0).read_text())
    t = load_file(str(rd.module_file(0)))
    t["blk.0.attn_q.weight"][0, 0] = np.inf
    m = write_module(rd, 0, t, {k: meta[k] for k in ("kind", "preset", "config")})
    for i in (1, 2, 3):  # experts re-recorded against the new trunk: only the Inf is wrong
        _rewrite_expert(run, i, lambda t, meta: meta.update(trunk_sha256=m["sha256"]), refresh=False)
    repool(run, m["sha256"])


def _flip_pooled(run):
    flip_byte(RunDir(run).router_stats)


def _retrained_expert(run):
    _rewrite_expert(run, 2, lambda t, meta: t["blk.0.ffn_up.weight"].__imul__(1.01), refresh=False)


def _no_pooled(run):
    RunDir(run).router_stats_meta.unlink()


def _other_trunk(run):
    _rewrite_expert(run, 1, lambda t, meta: meta.update(trunk_sha256="0" * 64))


def _missing(run):
    RunDir(run).module_file(2).unlink()


BAD = [
    (_truncate, [], "expert_002.*truncated"),
    (_flip_byte, [], "expert_002.*recorded blake3"),
    (_flip_pooled, [], "module router_stats .*recorded blake3"),
    (_no_pooled, [], "no pooled router statistics.*`mfgguf router-stats "),
    (lambda run: repool(run, "0" * 64), [], "pooled router statistics belong to another version of the trunk.*router-stats"),
    (_retrained_expert, [], "pooled router statistics predate expert_002.*router-stats"),
    (_wrong_shape, [], "expert_002.*blk.1.ffn_up.weight has shape \\[64, 64\\], expected \\[128, 64\\]"),
    (_nan, [], "expert_003.*blk.1.ffn_down.weight contains NaN or Inf"),
    (_inf, [], "trunk.*blk.0.attn_q.weight contains NaN or Inf"),
    (_other_trunk, [], "expert_001 was trained against a different trunk"),
    (_missing, [], "expert_002 is missing"),
    (None, ["--experts", "1,2,1"], "expert 1 is listed twice"),
    (None, ["--experts", "4"], "expert index 4 is out of range"),
    (None, ["--top-k", "4"], "--top-k 4 is out of range"),
    (None, ["--quant", "q3_k"], "unknown quant type 'q3_k'"),
]


@pytest.mark.parametrize("damage,args,pattern", BAD, ids=[p for _, _, p in BAD])
def test_bad_modules_one_error_line_destination_untouched(run_copy, tmp_path, damage, args, pattern):
    import re

    if damage:
        damage(run_copy)
    out = tmp_path / "m.gguf"
    out.write_bytes(b"old model")
    code, text = _cli("assemble", run_copy, "-o", out, "-q", "--force", *args)
    lines = text.strip().splitlines()
    assert code == 1 and len(lines) == 1 and lines[0].startswith("error: "), text
    assert re.search(pattern, lines[0]), lines[0]
    assert out.read_bytes() == b"old model"
    assert not list(tmp_path.glob(".m.gguf.*"))  # the temporary file is gone too


def test_sigkill_leaves_destination_untouched(tmp_path):
    run = synthetic_run(tmp_path / "big", preset="small", n_experts=6, vocab=600)
    for dest_exists in (False, True):
        out = tmp_path / f"m{dest_exists}.gguf"
        if dest_exists:
            out.write_bytes(b"precious")
        code = (f"from pathlib import Path; from mfgguf.converters.assemble import assemble; "
                f"assemble(Path({str(run)!r}), Path({str(out)!r}), quant='q4_k', threads=1, force=True, progress=False)")
        proc = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT)
        t0, tmp = time.time(), []
        while not tmp and time.time() - t0 < 60 and proc.poll() is None:
            tmp = [p for p in tmp_path.glob(f".{out.name}.*.tmp") if p.stat().st_size > 0]
            time.sleep(0.002)
        assert tmp and proc.poll() is None, "assembly finished before it could be killed"
        time.sleep(0.05)  # mid-stream
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        assert proc.returncode == -signal.SIGKILL
        if dest_exists:
            assert out.read_bytes() == b"precious"
        else:
            assert not out.exists()
    # the killed run's temporary files are cleaned by the next assembly of the same destination
    assemble(run, tmp_path / "mTrue.gguf", quant="q8_0", force=True, progress=False)
    assert not list(tmp_path.glob(".mTrue.gguf.*.tmp"))
    assert inspect_gguf(tmp_path / "mTrue.gguf")["n_experts"] == 6


def test_inspect_reports_everything(run, tmp_path):
    out = tmp_path / "m.gguf"
    assemble(run, out, quant="q4_k", top_k=2, progress=False)
    info = inspect_gguf(out)
    assert info["architecture"] == "granitemoe" and info["n_experts"] == 3 and info["top_k"] == 2
    stacked = sum(t["elements"] for t in info["tensors"] if t["stacked"])
    assert info["params_active"] == info["params_total"] - stacked // 3
    assert [e["id"] for e in info["experts"]] == [1, 2, 3]
    r0 = info["experts"][0]["ranges"][0]
    assert info["experts"][1]["ranges"][0][1] == r0[2]  # expert 2 starts where expert 1 ends
    assert info["provenance"]["mfgguf.router"] == "ridge" and len(info["provenance"]["mfgguf.module_sha256"]) == 4
    text = format_inspect(info)
    for s in ("granitemoe", "active per token", "q5_0", "row length 64", "expert 3", "mfgguf.module_sha256", "router stays F32",
              "router stats", "for `mfgguf extend`"):
        assert s in text, s
    code, out_text = _cli("inspect", out)
    assert code == 0 and out_text.strip() == text
    code, out_text = _cli("inspect", tmp_path / "nope.gguf")
    assert code == 1 and out_text.startswith("error:")


def test_library_raises_mfggufError_for_a_directory_output(run, tmp_path):
    with pytest.raises(MfggufError, match="is a directory"):
        assemble(run, tmp_path, progress=False)


def test_the_result_says_where_the_time_went(run, tmp_path):
    r = assemble(run, tmp_path / "m.gguf", progress=False)
    assert list(r["phases_s"]) == ["plan", "header", "preallocate", "stream", "merge", "fold", "router", "finish", "verify"]
    assert sum(r["phases_s"].values()) <= r["seconds"] + 0.01
    assert set(r["work_s"]) == {"read", "hash", "check", "quantize", "write"} and all(v >= 0 for v in r["work_s"].values())


def test_inspect_measures_the_router_rows_and_warns_where_experts_cannot_be_told_apart(run, tmp_path):
    from mfgguf.gguf.edit import read_f32, set_f32

    ridge, uniform = tmp_path / "ridge.gguf", tmp_path / "uniform.gguf"
    assemble(run, ridge, quant="f32", progress=False)
    assemble(run, uniform, quant="f32", router="uniform", progress=False)
    r = inspect_gguf(ridge)["router"]
    assert len(r["layers"]) == 2 and all(x["closest"] > 1e-2 for x in r["layers"]) and not r["warnings"]
    assert "router rows (per layer" in format_inspect(inspect_gguf(ridge))
    assert "every router row is the same in layers 0-1" in inspect_gguf(uniform)["router"]["warnings"][0]
    name = "blk.1.ffn_gate_inp.weight"
    w = read_f32(ridge, [name])[name].copy()  # (3, dim)
    w[2] = w[0]  # the router of layer 1 gives experts 1 and 3 the same row
    set_f32(ridge, {name: w})
    warnings = inspect_gguf(ridge)["router"]["warnings"]
    assert len(warnings) == 1 and "slots 0 and 2" in warnings[0] and "in layer 1:" in warnings[0]
    code, text = _cli("inspect", ridge)
    assert code == 0 and "warning: experts in slots 0 and 2" in text
