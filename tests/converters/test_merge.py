"""Merging the experts' trained copies of trunk tensors at assembly (`--merge none|mean`).

Experts with copies are synthetic (scripts/synthetic_run.py --shared: perturbed copies written
in the real module format); the merged tensors are read back from f32 GGUFs with gguf-py and
checked against hand-computed means; llama.cpp's
logits on merged files are checked against the PyTorch reference of the merged model.
"""

from __future__ import annotations

import json
import os
import re
import shutil

import gguf
import numpy as np
import pytest
from safetensors.numpy import load_file
from typer.testing import CliRunner

from mfgguf.cli.app import app
from mfgguf.config import shared_tensor_names
from mfgguf.converters.plan import layout as LY
from mfgguf.modules import merge as M
from mfgguf.converters.assemble import assemble
from mfgguf.errors import MfggufError
from mfgguf.run import SHARED_PREFIX, RunDir, write_module

from . import llama_logits, reference_logits, rel_diff, repool, synthetic_run, text_sample


@pytest.fixture(scope="module")
def attn_run(tmp_path_factory):
    """3 experts holding copies of norms + attention; expert 2 only of the norms (holders differ)."""
    run = synthetic_run(tmp_path_factory.mktemp("syn") / "run", preset="tiny", n_experts=3, vocab=400, shared="attn")
    cfg = LY.plan(RunDir(run), quant="f32", top_k=1, router="ridge", layout="shared-expert", experts=None, merge="none").cfg
    _rewrite(run, 2, _keep_shared(shared_tensor_names(cfg, "norms")))
    return run


@pytest.fixture(scope="module")
def all_run(tmp_path_factory):
    """3 experts holding copies of the whole trunk (embeddings, head and anchor too)."""
    return synthetic_run(tmp_path_factory.mktemp("syn") / "run", preset="tiny", n_experts=3, vocab=400, shared="all")


def _keep_shared(names):
    def change(t, meta):
        for k in [k for k in t if k.startswith(SHARED_PREFIX) and k[len(SHARED_PREFIX):] not in names]:
            del t[k]
        meta["shared_tensors"] = list(names)
    return change


def _rewrite(run, i, change):
    rd = RunDir(run)
    meta = json.loads(rd.module_meta(i).read_text())
    t = load_file(str(rd.module_file(i)))
    change(t, meta)
    keep = ("kind", "preset", "config", "shard", "trunk_sha256", "router_stats_count", "tokens_seen", "shared_tensors")
    write_module(rd, i, t, {k: meta[k] for k in keep if k in meta})
    repool(run)  # only the change is wrong, not the router's statistics


def _tensors(path) -> dict[str, np.ndarray]:
    r = gguf.GGUFReader(path)
    return {t.name: np.array(t.data, dtype=np.float32).reshape(tuple(int(d) for d in t.shape[::-1])) for t in r.tensors}


def _kv(path) -> dict:
    r = gguf.GGUFReader(path)
    out = {}
    for k, f in r.fields.items():
        if k.startswith("mfgguf."):
            v = f.parts[f.data[0]]
            out[k] = bytes(v).decode() if v.dtype == np.uint8 else v.tolist()[0]
    return out


def _cli(*args):
    r = CliRunner().invoke(app, [str(a) for a in args])
    return r.exit_code, r.output


# ---- the arithmetic ------------------------------------------------------------------------------


def test_mean_is_token_weighted_and_streaming_gives_the_same_bits(attn_run):
    rng = np.random.default_rng(1)
    T = rng.standard_normal((7, 32)).astype(np.float32)
    Cs = [T + rng.standard_normal((7, 32)).astype(np.float32) for _ in range(3)]
    got = M.merge_arrays("mean", T, Cs, tokens=[1, 1, 2])
    assert np.allclose(got, (Cs[0] + Cs[1] + 2 * Cs[2]) / 4, atol=1e-6)
    # the assembler's streaming form (tiny row chunks, preads) == the whole-array form, bit for bit
    p = LY.plan(RunDir(attn_run), quant="f32", top_k=1, router="ridge", layout="shared-expert", experts=None)
    name = "blk.1.attn_q.weight"
    mods = [p.expert_modules[i] for i in p.merged[name]]
    trunk = load_file(str(p.trunk.path))[name]
    copies = [load_file(str(m.path))[SHARED_PREFIX + name] for m in mods]
    chunks = list(M.merged_chunks(name, p.trunk, mods, chunk_bytes=3 * trunk.shape[1] * 4, method="mean"))
    assert len(chunks) > 1
    streamed = np.concatenate([x for _, x in chunks])
    whole = M.merge_arrays("mean", trunk, copies, [m.meta.tokens_seen for m in mods])
    assert streamed.tobytes() == whole.tobytes()
    os.utime(mods[0].path, ns=(0, 0))  # the file is not the one the plan read any more
    with pytest.raises(MfggufError, match="changed during assembly"):
        list(M.merged_chunks(name, p.trunk, mods, method="mean"))


# ---- the assembled file --------------------------------------------------------------------------


def test_mean_in_the_gguf_is_the_token_weighted_mean(attn_run, tmp_path):
    rd = RunDir(attn_run)
    trunk = load_file(str(rd.module_file(0)))
    ex = {i: load_file(str(rd.module_file(i))) for i in (1, 2, 3)}
    for experts in (None, [3, 2]):
        out = tmp_path / f"m{experts}.gguf"
        r = assemble(attn_run, out, quant="f32", experts=experts, progress=False)
        got = _tensors(out)
        ids = experts or [1, 2, 3]
        merged = 0
        for name, t in trunk.items():
            holders = [i for i in ids if SHARED_PREFIX + name in ex[i]]
            if not holders:  # not merged: the trunk's own tensor
                want = t
            else:  # by hand: tokens_seen = 1000 x expert id (synthetic_run)
                tok = np.array([1000.0 * i for i in holders])
                w = tok / tok.sum()
                want = t + sum(wi * (ex[i][SHARED_PREFIX + name].astype(np.float64) - t) for wi, i in zip(w, holders))
                merged += 1
                assert not np.allclose(want, t, atol=1e-3)
            assert np.allclose(got[name], want, rtol=0, atol=1e-6), name
        assert r["merged_tensors"] == merged == 2 * 6 + 1  # per layer 2 norms + 4 attention, output_norm
        kv = _kv(out)
        assert kv["mfgguf.merge"] == "mean" and kv["mfgguf.merged_tensors"] == merged
    # expert 3 alone: attention from expert 3 only (weight 1), so it is exactly its copy
    assemble(attn_run, tmp_path / "e3.gguf", quant="f32", experts=[3], progress=False)
    assert np.array_equal(_tensors(tmp_path / "e3.gguf")["blk.0.attn_v.weight"], ex[3][SHARED_PREFIX + "blk.0.attn_v.weight"])


def test_merge_none_is_todays_file(attn_run, tmp_path):
    """--merge none ignores the copies: the same file as from the same experts without copies."""
    none = tmp_path / "none.gguf"
    assemble(attn_run, none, quant="q8_0", merge="none", progress=False)
    stripped = shutil.copytree(attn_run, tmp_path / "stripped")
    for i in (1, 2, 3):
        _rewrite(stripped, i, _keep_shared([]))
    plain = tmp_path / "plain.gguf"
    r = assemble(stripped, plain, quant="q8_0", progress=False)  # default mean: nothing to merge
    assert r["merged_tensors"] == 0 and r["merge"] is None
    # only the experts' file hashes differ (same lengths): mask them, the rest is byte-identical
    masked = []
    for path, run in ((none, attn_run), (plain, stripped)):
        buf = path.read_bytes()
        for i in (1, 2, 3):
            h = json.loads(RunDir(run).module_meta(i).read_text())["sha256"].encode()
            assert buf.count(h) == 1
            buf = buf.replace(h, b"x" * 64)
        masked.append(buf)
    assert masked[0] == masked[1]
    assert "mfgguf.merge" not in _kv(none)


@pytest.mark.parametrize("run_name,layout,merge", [("attn_run", "shared-expert", "mean"), ("all_run", "shared-expert", "mean"),
                                                   ("all_run", "folded", "mean")])
def test_llama_cpp_logits_match_reference_of_the_merged_model(request, tmp_path, run_name, layout, merge):
    from tokenizers import Tokenizer

    run = request.getfixturevalue(run_name)
    ids = Tokenizer.from_file(str(run / "tokenizer.json")).encode(text_sample()).ids[:64]
    out = tmp_path / "m.gguf"
    assemble(run, out, quant="f32", layout=layout, top_k=2, merge=merge, progress=False)
    got = llama_logits(out, ids, 64)
    ref, _ = reference_logits(run, out, ids)
    assert rel_diff(got, ref) <= 1e-3, rel_diff(got, ref)
    plain = tmp_path / "plain.gguf"  # the merge matters: the unmerged model's logits are far off
    assemble(run, plain, quant="f32", layout=layout, top_k=2, merge="none", progress=False)
    assert rel_diff(got, llama_logits(plain, ids, 64)) > 1e-2


def test_the_reference_of_a_file_merged_with_the_removed_ties_is_refused(attn_run, tmp_path, monkeypatch):
    import mfgguf.reference as ref

    monkeypatch.setattr(ref, "gguf_provenance", lambda path: {"experts": [1], "top_k": 1, "router_rows": [],
                                                              "routed_seed": False, "merge": "ties", "arch": "granitemoe"})
    with pytest.raises(MfggufError, match="--merge ties, which mfgguf removed.*2a0bd6e"):
        ref.reference_model(attn_run, tmp_path / "ties.gguf")


# ---- bad input -----------------------------------------------------------------------------------


def _drop(t, meta):
    t.pop(SHARED_PREFIX + "blk.1.attn_q.weight")


def _misshape(t, meta):
    t[SHARED_PREFIX + "blk.0.attn_k.weight"] = t[SHARED_PREFIX + "blk.0.attn_k.weight"][:16]


def _unlisted(t, meta):
    meta["shared_tensors"] = [n for n in meta["shared_tensors"] if n != "output_norm.weight"]


def _not_trunk(t, meta):
    meta["shared_tensors"] = meta["shared_tensors"] + ["blk.0.ffn_up.weight"]


def _no_tokens(t, meta):
    meta.pop("tokens_seen")


BAD = [
    (_drop, [], "expert_003 lists shared tensor blk.1.attn_q.weight but holds no shared.blk.1.attn_q.weight"),
    (_misshape, [], r"expert_003: tensor shared.blk.0.attn_k.weight has shape \[16, 64\], the trunk's is \[32, 64\]"),
    (_unlisted, [], "expert_003 holds shared.output_norm.weight that its metadata does not list"),
    (_not_trunk, [], "expert_003 lists shared tensor blk.0.ffn_up.weight, which is not a trunk tensor"),
    (_no_tokens, [], "expert_003 records no tokens_seen"),
    (None, ["--merge", "avg"], "unknown merge 'avg'"),
    (None, ["--merge", "ties"], "merging with --merge ties, which mfgguf removed"),
]


@pytest.mark.parametrize("damage,args,pattern", BAD, ids=[re.sub(r"\W+", "-", p)[:40] for _, _, p in BAD])
def test_bad_shared_tensors_one_error_line_destination_untouched(attn_run, tmp_path, damage, args, pattern):
    run = shutil.copytree(attn_run, tmp_path / "run")
    if damage:
        _rewrite(run, 3, damage)
    out = tmp_path / "m.gguf"
    out.write_bytes(b"old model")
    code, text = _cli("assemble", run, "-o", out, "-q", "--force", *args)
    lines = text.strip().splitlines()
    assert code == 1 and len(lines) == 1 and lines[0].startswith("error: "), text
    assert re.search(pattern, lines[0]), lines[0]
    assert out.read_bytes() == b"old model"
    assert not list(tmp_path.glob(".m.gguf.*"))
