"""Conversations as training data: rendering with a chat template, the assistant-only loss mask, the refusals,
and a mixed RUN of text and conversations prepared into an imported chat base (tests/data/chat_base.py)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from mfgguf.base.known import cached
from mfgguf.cli.app import app
from mfgguf.data.chat import ChatTemplate, encode_conversations, parse_conversation, run_template
from mfgguf.data.masks import load_mask, mask_path
from mfgguf.errors import MfggufError
from mfgguf.run import RunDir
from tests.data.chat_base import CHATML, build_chat_run, chat_tokenizer, conversations, write_chat_gguf, write_jsonl

runner = CliRunner()
CONV = parse_conversation([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi <|im_end|> there"},
                           {"role": "assistant", "content": "Hello, how are you?"},
                           {"role": "user", "content": "Fine."}, {"role": "assistant", "content": "Good to hear."}], "t:1")


def cli(*args):
    return runner.invoke(app, [str(a) for a in args])


def masked_spans(ids: np.ndarray, mask: np.ndarray) -> list[list[int]]:
    """The runs of consecutive counted tokens."""
    spans, cur = [], []
    for t, m in zip(ids.tolist(), mask.tolist()):
        if m:
            cur.append(t)
        elif cur:
            spans.append(cur)
            cur = []
    return spans + ([cur] if cur else [])


def test_the_mask_covers_each_assistant_turn_and_its_end_of_turn_only():
    tok = chat_tokenizer()
    tpl = ChatTemplate(CHATML, "", "<|endoftext|>", ("<|im_start|>", "<|im_end|>"))
    ((ids, mask),) = encode_conversations(tok, tpl, [CONV], np.uint16)
    assert len(mask) == len(ids) + 1 and mask.dtype == np.uint8 and mask[-1] == 0  # the EOS prepare adds: context
    decoded = [tok.decode(s, skip_special_tokens=False) for s in masked_spans(ids, mask[:-1])]
    assert decoded == ["Hello, how are you?<|im_end|>", "Good to hear.<|im_end|>"]
    end = tok.token_to_id("<|im_end|>")
    assert int(np.sum(ids == end)) == 5  # one per turn (five): the user's spelling of it stayed text
    assert tok.decode(ids.tolist(), skip_special_tokens=False) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi <|im_end|> there<|im_end|>\n"
        "<|im_start|>assistant\nHello, how are you?<|im_end|>\n<|im_start|>user\nFine.<|im_end|>\n"
        "<|im_start|>assistant\nGood to hear.<|im_end|>\n")


def test_a_template_without_an_end_of_turn_lets_the_eos_close_the_last_turn():
    tok = chat_tokenizer()
    plain = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] | trim }}{% endfor %}"
    ((ids, mask),) = encode_conversations(tok, ChatTemplate(plain, "", "", ()), [CONV], np.uint16)
    assert [tok.decode(s) for s in masked_spans(ids, mask[:-1])] == ["Hello, how are you?", "Good to hear."]
    assert mask[-1] == 1  # the document's EOS ends the last assistant turn


@pytest.mark.parametrize("template,message", [
    ("{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}"
     "{{ m['content'] }}{% endfor %}", "refuses this conversation (System role not supported)"),
    ("{% for m in messages %}{% if m['role'] != 'assistant' %}{{ m['content'] }}{% endif %}{% endfor %}",
     "leaves out assistant message 2"),
    ("{% for m in messages %}{{ m['content'] }}{{ m['content'] }}{% endfor %}", "repeats assistant message 2"),
])
def test_a_template_that_cannot_show_the_assistant_turns_is_refused_naming_the_line(template, message):
    with pytest.raises(MfggufError, match="^t:1: ") as e:
        ChatTemplate(template, "", "", ()).pieces(CONV)
    assert message in str(e.value)


def test_smollm2s_own_template_and_tokenizer(tmp_path):
    gguf = cached("smollm2")
    if gguf is None:
        pytest.skip("SmolLM2-135M-Instruct is not fetched: run `make smollm2`")
    from mfgguf.base.runbase import BaseFiles, LlamaCppTokenizer

    (tmp_path / "base").mkdir()
    (tmp_path / "base" / "vocab.gguf").symlink_to(gguf)  # only its header and vocabulary are read
    base = BaseFiles(tmp_path)
    tpl = run_template(base)
    assert "<|im_end|>" in tpl.specials and "<|im_start|>" in tpl.source
    tok = LlamaCppTokenizer(base.vocab)
    ((ids, mask),) = encode_conversations(tok, tpl, [CONV], np.uint32)
    text = lambda s: tok.llm.detokenize(s, special=True).decode()  # noqa: E731
    assert [text(s) for s in masked_spans(ids, mask[:-1])] == ["Hello, how are you?<|im_end|>", "Good to hear.<|im_end|>"]
    assert text(ids.tolist()).startswith("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi <|im_end|> there")
    assert int(np.sum(ids == base.special_id("eos"))) == 5  # SmolLM2's EOS is <|im_end|>: one per turn, the user's is text


# ---- refusals, through the CLI: one line, exit 1, nothing written --------------------------------------------


@pytest.mark.parametrize("line,message", [
    ('{"messages": [{"role": "user", "content": "hi"}', "is not valid JSON"),
    ('{"prompt": "hi"}', "has no field 'text' (has: prompt); pass --text-field, or give a conversation a `messages`"),
    ('{"messages": "hi"}', "`messages` is str, not a list"),
    ('{"messages": [{"role": "robot", "content": "hi"}, {"role": "assistant", "content": "x"}]}', "unknown role 'robot'"),
    ('{"messages": [{"role": "user", "content": "hi"}]}', "has no assistant turn"),
    ('{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": ["x"]}]}',
     "has content of type list, not a string"),
])
def test_a_bad_conversation_is_refused_with_its_file_and_line(tmp_path, line, message):
    good = json.dumps(conversations(1)[0])
    src = write_jsonl(tmp_path / "chat.jsonl", [good, good, line])
    out = tmp_path / "run"
    r = cli("prepare", src, "--out", out, "--experts", "1", "--no-progress")
    assert r.exit_code == 1 and "Traceback" not in r.output, r.output
    assert f"{src}:3" in r.output and message in r.output, r.output
    assert not out.exists() and [p.name for p in tmp_path.iterdir()] == ["chat.jsonl"]


def test_conversations_without_a_chat_template_are_refused(tmp_path):
    src = write_jsonl(tmp_path / "chat.jsonl", conversations(20))
    r = cli("prepare", src, "--out", tmp_path / "run", "--experts", "1", "--vocab-size", "300", "--no-progress")
    assert r.exit_code == 1 and "conversations need a chat template" in r.output, r.output
    assert not (tmp_path / "run").exists()


# ---- a mixed RUN ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def chat_run(tmp_path_factory) -> Path:
    return build_chat_run(tmp_path_factory.mktemp("chatrun"))


def test_a_mixed_run_masks_the_conversations_only(chat_run):
    from mfgguf.base.runbase import BaseFiles, base_tokenizer

    rd = RunDir(chat_run)
    info = rd.info()
    assert info["conversations"] == 120 and sorted(info["domains"]) == ["chat", "prose"]
    chat_shard = next(s for s in info["shards"] if "chat" in s["domains"])
    prose_shard = next(s for s in info["shards"] if "prose" in s["domains"])
    assert not mask_path(rd.shard(prose_shard["id"])).exists()  # raw text: no mask, every token counts
    assert load_mask(rd.shard(prose_shard["id"])) is None
    tokens = np.load(rd.shard(chat_shard["id"]))
    mask = load_mask(rd.shard(chat_shard["id"]), len(tokens))
    assert 0 < chat_shard["counted"] == int(mask.sum()) < len(tokens)
    for split in (rd.valid("chat"), rd.test("chat"), rd.train_tokens):
        assert len(load_mask(split)) == len(np.load(split))
    assert mask_path(rd.valid("chat")).name == "chat.mask" and not mask_path(rd.valid("prose")).exists()
    # what is counted is exactly the assistants' contents, each with its <|im_end|>
    tok = base_tokenizer(BaseFiles(chat_run))
    want = {m["content"] + "<|im_end|>" for c in conversations(120) for m in c["messages"] if m["role"] == "assistant"}
    got = [tok.llm.detokenize(s, special=True).decode() for s in masked_spans(tokens, mask)]
    assert got and set(got) <= want and len(got) > 60


def test_a_base_without_a_chat_template_refuses_conversations(tmp_path):
    """The same base without its template: conversations are refused in one line, the RUN left as it was."""
    d = tmp_path
    r = cli("import-base", write_chat_gguf(d / "base.gguf", template=None), "--out", d / "run", "--preset", "tiny",
            "--ctx-len", "64")
    assert r.exit_code == 0, r.output
    before = sorted(p.name for p in (d / "run").rglob("*"))
    r = cli("prepare", write_jsonl(d / "c.jsonl", conversations(10)), "--out", d / "run", "--experts", "1", "--no-progress")
    assert r.exit_code == 1 and "has no chat template" in r.output, r.output
    assert sorted(p.name for p in (d / "run").rglob("*")) == before
