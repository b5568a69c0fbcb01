"""`prepare` end to end on real text, the RUN layout it writes, and the `mfgguf prepare` CLI."""

from __future__ import annotations

import hashlib
import json
import re
import time
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from mfgguf.data.prepare import prepare
from mfgguf.data.tokenizer import load_tokenizer
from mfgguf.errors import MfggufError
from mfgguf.run import RUN_FORMAT, RUN_VERSION, RunDir

SMALL = dict(vocab_size=300, max_chars_per_domain=60_000, progress=False)


def _load(path: Path) -> np.ndarray:
    return np.load(path, mmap_mode="r", allow_pickle=False)


def _docs(tok, arr: np.ndarray, eos: int) -> list[str]:
    """Split a token file at EOS and decode each document."""
    arr = np.asarray(arr)
    assert len(arr) and arr[-1] == eos  # every document ends with EOS
    cuts = np.flatnonzero(arr == eos)
    starts = np.concatenate([[0], cuts[:-1] + 1])
    return [tok.decode(arr[s:e].tolist()) for s, e in zip(starts, cuts)]


def _tree_digest(root: Path) -> str:
    h = hashlib.sha256()
    for p in sorted(root.rglob("*")):
        h.update(str(p.relative_to(root)).encode())
        if p.is_file():
            h.update(p.read_bytes())
    return h.hexdigest()


def test_prepared_run_layout_and_run_json(prepared_run):
    run = RunDir(prepared_run)
    info = run.info()
    assert info["format"] == RUN_FORMAT and info["version"] == RUN_VERSION
    assert info["n_experts"] == 3 and info["partition"] == "label" and info["overlap"] == 0.0
    assert info["vocab_size"] == 512 and info["eos_id"] == 0 and info["token_dtype"] == "uint16"
    assert set(info["domains"]) >= {"python", "english"}
    assert info["sources"] == ["builtin"] and info["seed"] == 0 and info["test_frac"] == 0.05
    assert isinstance(info["created"], str)
    tok = load_tokenizer(run.tokenizer)
    assert tok.get_vocab_size() == info["vocab_size"]
    train = _load(run.train_tokens)
    assert train.dtype == np.uint16 and train.ndim == 1 and len(train) == info["train_tokens"]
    assert int(train.max()) < info["vocab_size"]
    assert [s["id"] for s in info["shards"]] == [1, 2, 3]
    total = 0
    for s in info["shards"]:
        arr = _load(run.shard(s["id"]))
        assert arr.dtype == np.uint16 and len(arr) == s["tokens"] == sum(s["domains"].values())
        assert int((arr == 0).sum()) == s["docs"]
        assert len(s["domains"]) == 1  # label partition with one expert per domain
        total += len(arr)
    assert total == info["train_tokens"]  # no overlap: the shards are exactly the trunk's data
    assert {next(iter(s["domains"])) for s in info["shards"]} == set(info["domains"])
    for d, h in info["test"].items():
        arr = _load(run.test(d))
        assert len(arr) == h["tokens"] and int((arr == 0).sum()) == h["docs"] >= 1


def test_split_is_disjoint_from_all_training_text(prepared_run):
    run = RunDir(prepared_run)
    info = run.info()
    tok = load_tokenizer(run.tokenizer)
    train_docs = set(_docs(tok, _load(run.train_tokens), 0))
    shard_docs = set()
    for s in info["shards"]:
        shard_docs |= set(_docs(tok, _load(run.shard(s["id"])), 0))
    assert shard_docs == train_docs
    assert set(info["test"]) == set(info["domains"])
    for d in info["test"]:
        held = _docs(tok, _load(run.test(d)), 0)
        assert run.test_text(d).read_text(encoding="utf-8") == "\n\n".join(held)  # .txt == .npy's documents
        assert not set(held) & train_docs
        assert all(len(x) > 100 for x in held)


def test_fixture_is_fast(tmp_path):
    t = time.time()
    prepare(["builtin"], tmp_path / "run", n_experts=3, vocab_size=512, max_chars_per_domain=400_000, seed=0,
            progress=False)
    assert time.time() - t < 20


def test_random_partition_with_overlap_and_cluster_centres(tmp_path):
    info = prepare(["builtin"], tmp_path / "r", n_experts=4, partition="random", overlap=0.5, seed=1, **SMALL)
    shard_tokens = sum(s["tokens"] for s in info["shards"])
    assert 1.25 * info["train_tokens"] < shard_tokens < 1.75 * info["train_tokens"]
    assert all(len(s["domains"]) >= 2 for s in info["shards"])
    info = prepare(["builtin"], tmp_path / "c", n_experts=3, partition="cluster", **SMALL)
    docs = [s["docs"] for s in info["shards"]]
    assert max(docs) - min(docs) <= 1
    from safetensors.numpy import load_file

    cl = load_file(str(RunDir(tmp_path / "c").clusters))
    assert cl["centres"].shape == (3, len(cl["terms"])) and cl["idf"].shape == cl["terms"].shape
    assert int(cl["terms"].max()) < info["vocab_size"]
    assert not RunDir(tmp_path / "r").clusters.exists()


def test_user_sources_with_labels(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    stdlib = Path(json.__file__).parent.parent
    for name in ("argparse.py", "textwrap.py", "shlex.py"):
        (src / name).write_text((stdlib / name).read_text())
    notes = tmp_path / "notes.jsonl"
    notes.write_text("\n".join(json.dumps({"text": (stdlib / "this.py").read_text() + f"\nnote {i}\n"})
                               for i in range(40)) + "\n")
    info = prepare([f"code={src}", str(notes)], tmp_path / "run", n_experts=2, vocab_size=400, progress=False)
    assert info["domains"] == ["code", "notes"]
    assert [set(s["domains"]) for s in info["shards"]] == [{"code"}, {"notes"}]
    assert info["test"]["notes"]["docs"] == 2  # round(0.05 * 40)


def test_force_replaces_only_after_success_and_failures_leave_nothing(tmp_path):
    out = tmp_path / "run"
    prepare(["builtin"], out, n_experts=2, **SMALL)
    before = _tree_digest(out)
    with pytest.raises(MfggufError, match="already exists"):
        prepare(["builtin"], out, n_experts=3, **SMALL)
    with pytest.raises(MfggufError, match="does not exist"):
        prepare([str(tmp_path / "missing")], out, n_experts=3, force=True, **SMALL)
    # fails late (after tokenizing): more experts than documents
    with pytest.raises(MfggufError, match="experts"):
        prepare(["builtin"], out, n_experts=500, force=True, **SMALL)
    assert _tree_digest(out) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]  # no temporary directories left
    info = prepare(["builtin"], out, n_experts=3, force=True, **SMALL)
    assert RunDir(out).info()["n_experts"] == 3 == info["n_experts"]
    assert RunDir(out).shard(3).is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]
    with pytest.raises(MfggufError, match="experts"):
        prepare(["builtin"], tmp_path / "new", n_experts=500, **SMALL)
    assert not (tmp_path / "new").exists()
    (tmp_path / "empty").mkdir()
    prepare(["builtin"], tmp_path / "empty", n_experts=1, **SMALL)  # an empty directory is fine


@pytest.mark.parametrize("kw, msg", [
    (dict(n_experts=0), "at least 1"),
    (dict(n_experts=2, partition="topic"), "unknown partition"),
    (dict(n_experts=2, vocab_size=100), "too small"),
    (dict(n_experts=2, overlap=1.0), "overlap"),
    (dict(n_experts=2, test_frac=1.5), "held-out fraction"),
])
def test_invalid_arguments(tmp_path, kw, msg):
    with pytest.raises(MfggufError, match=msg):
        prepare(["builtin"], tmp_path / "run", **{**dict(progress=False), **kw})
    assert not (tmp_path / "run").exists()


# ---- CLI ---------------------------------------------------------------------------------------------


def _cli(*args):
    from mfgguf.cli.app import app

    return CliRunner().invoke(app, ["prepare", *map(str, args)])


def test_cli_prepare_success(tmp_path):
    out = tmp_path / "run"
    r = _cli("builtin", "--out", out, "--experts", 2, "--vocab-size", 300, "--max-chars-per-domain", 60_000,
             "--partition", "random", "--overlap", 0.2, "--seed", 5, "--heldout-frac", 0.1, "--no-progress")
    assert r.exit_code == 0, r.output
    info = RunDir(out).info()
    assert info["partition"] == "random" and info["overlap"] == 0.2 and info["seed"] == 5
    assert info["test_frac"] == 0.1  # --test-frac's earlier name is still accepted
    assert "expert 1" in r.stdout and "expert 2" in r.stdout and re.search(r"│ test +│", r.stdout)
    assert f"{info['train_tokens']:,}" in r.stdout


def _assert_one_error_line(r):
    assert r.exit_code == 1, r.output
    assert "Traceback" not in r.output
    assert r.exception is None or isinstance(r.exception, SystemExit)
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1, r.stderr
    assert r.stderr.strip().splitlines()[-1] == lines[0]


def test_cli_bad_inputs_exit_1_with_one_error_line(tmp_path):
    existing = tmp_path / "existing"
    prepare(["builtin"], existing, n_experts=2, **SMALL)
    before = _tree_digest(existing)
    empty = tmp_path / "emptydir"
    empty.mkdir()
    bad = [
        [empty, "--out", tmp_path / "a", "--experts", 2],
        [tmp_path / "no" / "such" / "path", "--out", tmp_path / "b", "--experts", 2],
        ["builtin", "--out", tmp_path / "c", "--experts", 0],
        ["builtin", "--out", existing, "--experts", 2, "--max-chars-per-domain", 60_000],
        [empty, "--out", existing, "--experts", 2, "--force"],
    ]
    for args in bad:
        r = _cli(*args)
        _assert_one_error_line(r)
    r = _cli(empty, "--out", tmp_path / "d", "--experts", 2, "--progress")  # progress bars do not hide the error
    _assert_one_error_line(r)
    assert "emptydir" in r.stderr
    assert _tree_digest(existing) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["emptydir", "existing"]
