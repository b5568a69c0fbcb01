"""Opening a GGUF: header checks, context limits, explicit close; bad input through every verb."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from mfgguf.cli.app import app
from mfgguf.errors import MfggufError
from mfgguf.runtime.llm import loaded, read_header


def test_header_of_assembled_model(tiny_gguf):
    h = read_header(tiny_gguf)
    assert h["arch"] in ("granitemoe", "llama")
    assert h["context_length"] >= 16 and h["n_vocab"] >= 256


def test_loaded_closes_and_respects_ctx(tiny_gguf):
    n = read_header(tiny_gguf)["context_length"]
    with loaded(tiny_gguf, n_ctx=n // 2) as llm:
        assert llm.mfgguf_n_ctx == n // 2
        assert llm.tokenize(b"def main():")  # the GGUF's own tokenizer works
    with pytest.raises(MfggufError, match="longer than the model's trained context"):
        loaded(tiny_gguf, n_ctx=n + 1).__enter__()


def test_truncated_gguf_is_reported(tiny_gguf, tmp_path):
    bad = tmp_path / "cut.gguf"
    bad.write_bytes(tiny_gguf.read_bytes()[:100])  # magic right, the rest cut off
    with pytest.raises(MfggufError, match="damaged GGUF"):
        read_header(bad)
    import gguf

    end = max(int(t.data_offset + t.n_bytes) for t in gguf.GGUFReader(tiny_gguf).tensors)  # gguf-py's reading
    bad.write_bytes(tiny_gguf.read_bytes()[: end - 64])  # the header whole, the last tensor's bytes cut short
    with pytest.raises(MfggufError, match="damaged GGUF: its tensors end past"):
        read_header(bad)


def _bad_inputs(tiny_gguf, gpt2_gguf, tmp_path):
    text = tmp_path / "notes.txt"
    text.write_text("this is not a model\n" * 50)
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    n = read_header(tiny_gguf)["context_length"]
    missing = str(tmp_path / "missing.gguf")
    return [
        (["generate", missing, "hi"], "model file not found"),
        (["chat", missing], "model file not found"),
        (["serve", missing], "model file not found"),
        (["perplexity", missing, "--data", str(text)], "model file not found"),
        (["generate", str(text), "hi"], "not a GGUF file"),
        (["perplexity", str(text), "--data", str(text)], "not a GGUF file"),
        (["generate", str(gpt2_gguf), "hi"], "architecture 'gpt2'"),
        (["chat", str(gpt2_gguf)], "architecture 'gpt2'"),
        (["perplexity", str(tiny_gguf), "--data", str(empty)], "is empty"),
        (["perplexity", str(tiny_gguf), "--data", str(text), "--ctx", str(n + 1)], "longer than the model's trained context"),
        (["generate", str(tiny_gguf), "hi", "--ctx", str(n * 2)], "longer than the model's trained context"),
        (["serve", str(tiny_gguf), "--ctx", str(n * 2)], "longer than the model's trained context"),
        (["chat", str(tiny_gguf), "--ctx", str(n * 2)], "longer than the model's trained context"),
        (["perplexity", str(tiny_gguf)], "either --data FILE or --run RUN"),
        (["perplexity", str(tiny_gguf), "--run", str(tmp_path)], "not a RUN directory"),
    ]


def test_bad_input_is_one_error_line(tiny_gguf, gpt2_gguf, tmp_path):
    runner = CliRunner()
    for args, expected in _bad_inputs(tiny_gguf, gpt2_gguf, tmp_path):
        r = runner.invoke(app, args)
        assert r.exit_code == 1, (args, r.output)
        err = r.stderr.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error: ") and expected in err[0], (args, r.stderr)
        assert "Traceback" not in r.output
        assert isinstance(r.exception, SystemExit)  # a clean exit, not an escaped exception
