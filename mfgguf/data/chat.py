"""Conversations as training data: JSONL lines with a `messages` list, rendered with the base's chat template and
tokenized with a loss mask that is 1 on the assistant's turns.

A conversation is `{"messages": [{"role": "system" | "user" | "assistant" | "tool", "content": "..."}, ...]}`
(the form TRL, axolotl and LLaMA-Factory read). It is rendered with the chat template the imported base carries
(its GGUF's `tokenizer.chat_template`, which the assembled model keeps and llama.cpp's `--jinja` renders), so the
experts learn the very format the model is prompted in.

How the assistant's tokens are found: the template is rendered once with each message's content replaced by a
marker, which splits the rendered text into the template's own text and the messages' contents, exactly where
the template put them (a template that rewrites earlier turns, as Qwen3's does with its thinking blocks, is no
obstacle). The template's text is tokenized with its special tokens (`<|im_start|>`); each content on its own,
as plain text (a special token's spelling inside a message stays text, as in raw documents). The mask is 1 on
an assistant content's tokens and on the end-of-turn that closes it: the template's text after the content up
to its first special token (`<|im_end|>`, `<|eot_id|>`), when only whitespace comes before it; where the
template closes the last assistant turn with nothing, the document's EOS is that end. Everything else (system,
user and tool turns, the role headers) is context: 0.

A RUN without a chat template (a tokenizer `prepare` trained, or a base whose file has none) refuses
conversations: there is no format the model would be prompted in to train.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

import numpy as np

from mfgguf.errors import MfggufError

ROLES = ("system", "user", "assistant", "tool")
_MARK = re.compile("\ue000([0-9]+)\ue001")  # a message's place in the rendered text (private-use characters)
TEMPLATE, CONTENT, CLOSE = 0, 1, 2  # a piece of a rendered conversation: the template's text, a message, an end of turn


@dataclass(frozen=True)
class Conversation:
    """One JSONL line's conversation: (role, content) pairs, and the line it came from (for errors)."""

    messages: tuple[tuple[str, str], ...]
    where: str

    def text(self) -> str:
        """A plain text of the conversation (the split's .txt files, the per-domain character cap)."""
        return "\n\n".join(f"{r}: {c}" for r, c in self.messages)


def parse_conversation(messages, where: str) -> Conversation:
    """A JSONL record's `messages` value as a Conversation, or a one-line error naming WHERE (file:line)."""
    if not isinstance(messages, list):
        raise MfggufError(f"{where}: `messages` is {type(messages).__name__}, not a list of"
                          " {\"role\", \"content\"} objects")
    out = []
    for k, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m:
            raise MfggufError(f"{where}: message {k} is not a {{\"role\", \"content\"}} object")
        role, content = m["role"], m.get("content")
        if role not in ROLES:
            raise MfggufError(f"{where}: message {k} has unknown role {role!r}; use one of {', '.join(ROLES)}")
        if not isinstance(content, str):
            raise MfggufError(f"{where}: message {k} ({role}) has content of type {type(content).__name__}, not a string")
        if "\ue000" in content or "\ue001" in content:
            raise MfggufError(f"{where}: message {k} holds U+E000 or U+E001, the private-use characters mfgguf marks"
                              " messages with; remove them")
        out.append((role, content))
    if not any(r == "assistant" for r, _ in out):
        raise MfggufError(f"{where}: the conversation has no assistant turn, so nothing in it would be trained")
    return Conversation(tuple(out), where)


@dataclass(frozen=True)
class ChatTemplate:
    """A base's chat template with what rendering and masking need: its BOS and EOS text and its special tokens."""

    source: str
    bos: str
    eos: str
    specials: tuple[str, ...]  # the vocabulary's control tokens' text, longest first

    def pieces(self, conv: Conversation) -> list[tuple[str, int, bool]]:
        """The rendered conversation as (text, kind, trained) pieces, in order; kind TEMPLATE, CONTENT or CLOSE."""
        rendered = self._render(conv)
        roles = [r for r, _ in conv.messages]
        out, pos, seen = [], 0, []
        for m in _MARK.finditer(rendered):
            k = int(m.group(1))
            if k >= len(roles):
                raise MfggufError(f"{conv.where}: the chat template changed a message's content beyond recognition")
            out += self._template_text(rendered[pos: m.start()], out)
            out.append((conv.messages[k][1], CONTENT, roles[k] == "assistant"))
            seen.append(k)
            pos = m.end()
        out += self._template_text(rendered[pos:], out)
        for k, role in enumerate(roles):
            if role == "assistant" and seen.count(k) != 1:
                how = "leaves out" if k not in seen else "repeats"
                raise MfggufError(f"{conv.where}: the chat template {how} assistant message {k}, so its tokens cannot"
                                  " be told apart; this template cannot train on conversations")
        return out

    def _template_text(self, text: str, before: list) -> list[tuple[str, int, bool]]:
        """The template's text after a piece: its end of turn first (trained) when it follows an assistant turn."""
        if not text:
            return []
        if before and before[-1][1] == CONTENT and before[-1][2]:
            head = self._turn_end(text)
            if head:
                return [(head, CLOSE, True)] + ([(text[len(head):], TEMPLATE, False)] if len(head) < len(text) else [])
        return [(text, TEMPLATE, False)]

    def _turn_end(self, text: str) -> str:
        """TEXT up to and with its first special token, if only whitespace precedes it; else ''."""
        stripped = text.lstrip()
        for s in self.specials:  # longest first: `<|im_end|>` before any shorter token it starts with
            if stripped.startswith(s):
                return text[: len(text) - len(stripped) + len(s)]
        return ""

    def _render(self, conv: Conversation) -> str:
        msgs = [{"role": r, "content": f"\ue000{k}\ue001"} for k, (r, _) in enumerate(conv.messages)]
        try:
            return _compiled(self.source).render(messages=msgs, bos_token=self.bos, eos_token=self.eos,
                                                 add_generation_prompt=False)
        except Exception as e:  # jinja2's errors and the template's own raise_exception: the template refuses it
            msg = (str(e).strip().splitlines() or [type(e).__name__])[0]
            raise MfggufError(f"{conv.where}: the chat template refuses this conversation ({msg})") from None


_CACHE: dict[str, object] = {}


def _compiled(source: str):
    """The template compiled as transformers compiles chat templates (sandboxed, trimmed blocks, loop controls)."""
    if source not in _CACHE:
        from jinja2 import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message):
            raise TemplateError(message)

        def tojson(x, indent=None, separators=None, sort_keys=False, ensure_ascii=False):
            return json.dumps(x, indent=indent, separators=separators, sort_keys=sort_keys, ensure_ascii=ensure_ascii)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
        env.filters["tojson"] = tojson
        env.globals["raise_exception"] = raise_exception
        try:
            _CACHE[source] = env.from_string(source)
        except TemplateError as e:
            raise MfggufError(f"the base's chat template does not compile ({e}); conversations need a working one") from None
    return _CACHE[source]


def run_template(base) -> ChatTemplate:
    """The chat template of an imported base (RUN/base/vocab.gguf), or a one-line refusal where there is none."""
    how = ("flatten the conversations to text, or import a base that has one (`mfgguf import-base`) and prepare into"
           " its RUN")
    if base is None:
        raise MfggufError(f"conversations need a chat template, and a RUN whose tokenizer `prepare` trains has none; {how}")
    source = base.value("tokenizer.chat_template")
    if not source:
        raise MfggufError(f"the imported base has no chat template (its GGUF lacks tokenizer.chat_template); {how}")
    tokens, types = base.value("tokenizer.ggml.tokens"), base.value("tokenizer.ggml.token_type") or []
    specials = sorted({tokens[i] for i, t in enumerate(types) if int(t) == 3}, key=len, reverse=True)  # 3: CONTROL

    def text(kind: str) -> str:
        i = base.special_id(kind)
        return tokens[i] if i is not None and 0 <= i < len(tokens) else ""

    return ChatTemplate(str(source), text("bos"), text("eos"), tuple(s for s in specials if s))


def encode_conversations(tok, template: ChatTemplate, convs: list[Conversation], dtype) -> list[tuple[np.ndarray, np.ndarray]]:
    """(token ids, mask) of each conversation; the mask is one longer than the ids: its last entry is for the EOS
    `prepare` appends (1 where that EOS ends the last assistant turn)."""
    pieces = [template.pieces(c) for c in convs]
    flat = [p for ps in pieces for p in ps]
    ids = _encode(tok, [t for t, kind, _ in flat if kind != CONTENT], special=True)
    ids_content = _encode(tok, [t for t, kind, _ in flat if kind == CONTENT], special=False)
    out = []
    for ps in pieces:
        parts, mask = [], []
        for text, kind, trained in ps:
            got = next(ids_content) if kind == CONTENT else next(ids)
            parts.append(got)
            mask.append(np.full(len(got), trained, dtype=np.uint8))
        mask.append(np.array([_eos_closes(ps)], dtype=np.uint8))
        out.append((np.concatenate(parts).astype(dtype) if parts else np.zeros(0, dtype), np.concatenate(mask)))
    return out


def _eos_closes(pieces) -> bool:
    """Whether the conversation ends in an assistant turn that the template closes with nothing but whitespace."""
    for text, kind, trained in reversed(pieces):
        if kind == CONTENT:
            return trained
        if kind == CLOSE or text.strip():
            return False
    return False


def _encode(tok, texts: list[str], special: bool):
    """Token ids of each text: special tokens parsed (the template's text) or spelled as plain text (contents)."""
    prev = tok.encode_special_tokens
    tok.encode_special_tokens = not special
    try:
        encs = tok.encode_batch(texts, add_special_tokens=False) if texts else []
    finally:
        tok.encode_special_tokens = prev
    return iter([np.asarray(e.ids, dtype=np.int64) for e in encs])
