"""An interactive chat in the terminal over llama-cpp-python, replies streamed token by token.

The prompt is built by llama-cpp-python from the GGUF's own chat template
(`tokenizer.chat_template`). The conversation is kept within the model's trained context by
dropping the oldest turns. Ctrl-C stops the reply being written and returns to the prompt;
Ctrl-D or /quit leaves; /reset starts a new conversation. The model is closed explicitly on
every way out, so nothing prints a traceback at exit.

Example:
    >>> from mfgguf.runtime.chat import chat
    >>> chat("model.gguf", temperature=0.7)
"""

from __future__ import annotations

import signal
import sys
import unicodedata
from pathlib import Path

from mfgguf.runtime.generate import check_sampling
from mfgguf.runtime.llm import loaded

PROMPT = ">>> "
HELP = "/reset starts over, /quit or Ctrl-D leaves, Ctrl-C stops a reply"


def _printable(s: str) -> str:
    """Drop control characters (a small model may emit any byte) but keep newlines and tabs."""
    return "".join(c for c in s if c in "\n\t" or unicodedata.category(c) != "Cc")


class _Budget:
    """Counts the tokens of a rendered conversation, to keep it inside the trained context."""

    def __init__(self, llm):
        self.llm = llm
        self.n_ctx = llm.mfgguf_n_ctx
        template = llm.metadata.get("tokenizer.chat_template")
        self.formatter = None
        if template:
            from llama_cpp.llama_chat_format import Jinja2ChatFormatter

            text = lambda i: llm._model.token_get_text(i) if i != -1 else ""  # as llama-cpp-python does
            self.formatter = Jinja2ChatFormatter(template, text(llm.token_eos()), text(llm.token_bos()))

    def count(self, messages: list[dict]) -> int:
        if self.formatter is not None:
            try:
                prompt = self.formatter(messages=messages).prompt
                return len(self.llm.tokenize(prompt.encode("utf-8"), add_bos=True, special=True))
            except Exception:  # a template our renderer rejects: fall back to an estimate
                pass
        return sum(len(self.llm.tokenize(m["content"].encode("utf-8"), add_bos=False)) + 8 for m in messages)

    def fit(self, history: list[dict], reserve: int) -> tuple[list[dict], int]:
        """Drop the oldest turns until the prompt leaves `reserve` tokens for the reply."""
        while True:
            n = self.count(history)
            if n + reserve <= self.n_ctx or len(history) <= 1:
                return history, n
            del history[0]


SHOWN_EXPERTS = 8  # experts named in the banner; the rest counted


def banner(h: dict, path: Path, n_ctx: int) -> str:
    """The model's name and, for a MoE, its experts by label and how many a token uses."""
    line = f"{h['name'] or path.name} ({h['arch']}, context {n_ctx} tokens"
    ex = h.get("experts") or []
    if ex:
        shown = ", ".join(ex[:SHOWN_EXPERTS]) + (f", ... ({len(ex)} in all)" if len(ex) > SHOWN_EXPERTS else "")
        line += f"; experts: {shown}; {h.get('experts_per_token')} a token"
    return line + ")"


def chat(
    model: Path,
    *,
    temperature: float = 0.8,
    top_p: float = 0.95,
    top_k: int = 40,
    seed: int = 0,
    max_tokens: int = 256,
    n_ctx: int | None = None,
    lora: Path | None = None,
    experts_per_token: int | None = None,
    show_experts: bool = False,
) -> None:
    """Chat with MODEL in the terminal; replies stream as they are produced.

    Uses the GGUF's chat template. Type a message and press Enter. /reset starts a new
    conversation, /quit or Ctrl-D leaves, Ctrl-C stops the current reply. Older turns are
    dropped when the conversation outgrows the model's context (--ctx, default: the trained one).
    --lora ADAPTER applies a llama.cpp LoRA adapter of MODEL (one domain's, from `train-base --mode lora`).
    --experts-per-token K routes each token to K experts instead of the file's own count (llama.cpp's metadata
    override). The banner names the model's base and its experts; --show-experts adds a line after each reply
    naming the experts it went through.

    Example:
        >>> chat("model.gguf", temperature=0.7, seed=1)
    """
    check_sampling(max_tokens, temperature, top_p, top_k)
    if sys.stdin.isatty() and signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        # started in the background of a script (`cmd &` ignores SIGINT): Ctrl-C is still how a reply stops here
        signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        import readline  # noqa: F401  line editing and history for input()
    except ImportError:
        pass
    with loaded(model, n_ctx=n_ctx, seed=seed, lora=lora, experts_per_token=experts_per_token) as llm:
        h = llm.mfgguf_header
        print(f"{banner(h, Path(model), llm.mfgguf_n_ctx)}. {HELP}.", flush=True)
        budget = _Budget(llm)
        history: list[dict] = []
        sampling = dict(temperature=temperature, top_p=top_p, top_k=top_k, max_tokens=max_tokens,
                        show_experts=show_experts and bool(h.get("n_experts")))
        while True:
            try:
                if not _turn(llm, budget, history, sampling):
                    return
            except KeyboardInterrupt:  # Ctrl-C anywhere in a turn: back to the prompt
                print(" [stopped]", flush=True)
                llm.reset()  # the interrupt may have landed between a decode and its bookkeeping


def _turn(llm, budget: "_Budget", history: list[dict], sampling: dict) -> bool:
    """Read one line and act on it; False means leave."""
    try:
        line = input(PROMPT)
    except EOFError:  # Ctrl-D
        print(flush=True)
        return False
    except KeyboardInterrupt:  # Ctrl-C at the prompt: a fresh line, stay
        print("\n(Ctrl-D or /quit to leave)", flush=True)
        return True
    text = line.strip()
    if text in ("/quit", "/exit"):
        return False
    if text == "/reset":
        history.clear()
        print("(new conversation)", flush=True)
    elif text.startswith("/"):
        print(f"unknown command {text.split()[0]}; {HELP}", flush=True)
    elif text:
        history.append({"role": "user", "content": line})
        pieces: list[str] = []
        try:
            ok = _reply(llm, budget, history, pieces, **sampling)
        finally:  # also on Ctrl-C: keep what was shown, so the conversation matches the screen
            if pieces:
                history.append({"role": "assistant", "content": "".join(pieces)})
            elif history and history[-1]["role"] == "user":
                history.pop()
        if not ok:
            return True
    return True


def _reply(llm, budget: _Budget, history: list[dict], pieces: list[str], *, temperature, top_p, top_k,
           max_tokens, show_experts: bool = False) -> bool:
    """Stream one reply to stdout, appending its text to `pieces`; False if it could not start."""
    reserve = min(max_tokens, budget.n_ctx // 2)
    history[:], n_prompt = budget.fit(history, reserve)
    room = budget.n_ctx - n_prompt
    if room < 1:
        print(f"(that message is {n_prompt} tokens; the model's context is {budget.n_ctx}: write less, or /reset)", flush=True)
        return False
    # seed=None: llama-cpp-python derives each reply's seed from the last, so a session is
    # reproducible from --seed without every reply to the same words being identical.
    stream = llm.create_chat_completion(history, stream=True, temperature=temperature, top_p=top_p, top_k=top_k,
                                        min_p=0.0, max_tokens=min(max_tokens, room))
    try:
        for chunk in stream:
            piece = chunk["choices"][0]["delta"].get("content")
            if piece:
                pieces.append(piece)
                sys.stdout.write(_printable(piece))
                sys.stdout.flush()
    finally:
        stream.close()
    sys.stdout.write("\n")
    if show_experts and pieces:
        sys.stdout.write(experts_line(llm, n_prompt) + "\n")
    sys.stdout.flush()
    return True


def experts_line(llm, n_prompt: int) -> str:
    """`(experts: python <share>, c <share>, ...)`: each expert's share of the reply's token-layers, first choice; the reply
    routed again on the open model's weights (runtime/route.py)."""
    from mfgguf.runtime.route import routes, summary

    ids = [int(t) for t in llm.input_ids[: llm.n_tokens]]
    r = routes(Path(llm.mfgguf_header["path"]), ids=ids, llm=llm)
    reply = r.slots[n_prompt:] if len(ids) > n_prompt else r.slots
    r.slots, r.weights = reply, r.weights[-len(reply):]
    shares = [(k, v["top1"]) for k, v in summary(r)["experts"].items() if v["top1"] >= 0.005]
    return "(experts: " + ", ".join(f"{k} {v:.0%}" for k, v in shares) + ")"
