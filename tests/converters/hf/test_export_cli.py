"""`mfgguf export-hf` through the CLI: a success line, and every bad input as one line, exit 1, no traceback,
nothing written."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.base.test_import_base import cli
from tests.converters import synthetic_run
from tests.converters.hf import assembled


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    return synthetic_run(tmp_path_factory.mktemp("cli") / "run", preset="tiny", n_experts=2, vocab=300)


@pytest.fixture(scope="module")
def moe(run) -> Path:
    return assembled(run, run.parent / "moe.gguf")


def refused(tmp_path: Path, what: str, *args) -> None:
    """export-hf ARGS -o tmp/out refuses with one line saying `what`, and writes nothing there."""
    out = tmp_path / "out"
    r = cli("export-hf", *args, "-o", out)
    assert r.exit_code == 1 and what in r.output and len(r.output.strip().splitlines()) == 1, r.output
    assert "Traceback" not in r.output and not out.exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".out.")] == []  # no temporary directory left


def test_writes_the_directory_and_says_what(moe, tmp_path):
    r = cli("export-hf", moe, "-o", tmp_path / "hf")
    assert r.exit_code == 0, r.output
    assert "GraniteMoeSharedForCausalLM (from granitemoe)" in r.output and "1 shard," in r.output
    assert {p.name for p in (tmp_path / "hf").iterdir()} == {
        "config.json", "generation_config.json", "model.safetensors", "special_tokens_map.json", "tokenizer.json",
        "tokenizer_config.json"}


def test_not_a_gguf(tmp_path):
    (tmp_path / "x.gguf").write_text("not a model")
    refused(tmp_path, "is not a GGUF file", tmp_path / "x.gguf")


def test_missing_file(tmp_path):
    refused(tmp_path, "does not exist", tmp_path / "nothing.gguf")


def test_dense_file(run, tmp_path):
    dense = assembled(run, tmp_path / "dense.gguf", "--experts", "none")
    refused(tmp_path, "is dense (no experts); export-hf takes an assembled MoE", dense)


def test_unsupported_architecture(tmp_path):
    import gguf

    w = gguf.GGUFWriter(str(tmp_path / "phi.gguf"), "phi2")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    w.close()
    refused(tmp_path, "is a phi2 file; export-hf writes granitemoe, qwen2moe, qwen3moe, and the folded layout",
            tmp_path / "phi.gguf")


def test_bad_dtype(moe, tmp_path):
    refused(tmp_path, "unknown --dtype 'q8_0'", moe, "--dtype", "q8_0")


def test_existing_output_needs_force(moe, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "old.txt").write_text("keep me")
    r = cli("export-hf", moe, "-o", out)
    assert r.exit_code == 1 and "exists and is not empty; pass --force" in r.output, r.output
    assert len(r.output.strip().splitlines()) == 1 and (out / "old.txt").read_text() == "keep me"
    r = cli("export-hf", moe, "-o", out, "--force")
    assert r.exit_code == 0, r.output
    assert not (out / "old.txt").exists() and (out / "config.json").is_file()
