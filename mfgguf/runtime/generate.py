"""Prompt in, text out: plain completion for scripts, deterministic for a given seed.

Example:
    >>> from mfgguf.runtime.generate import generate
    >>> generate("model.gguf", "The function", max_tokens=32, seed=1)
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

from mfgguf.errors import MfggufError
from mfgguf.runtime.llm import loaded


def check_sampling(max_tokens: int, temperature: float, top_p: float, top_k: int) -> None:
    if max_tokens < 1:
        raise MfggufError(f"--max-tokens {max_tokens} must be at least 1")
    if temperature < 0:
        raise MfggufError(f"--temperature {temperature} must be 0 (greedy) or more")
    if not 0 < top_p <= 1:
        raise MfggufError(f"--top-p {top_p} must be in (0, 1]")
    if top_k < 0:
        raise MfggufError(f"--top-k {top_k} must be 0 (off) or more")


def _stream(llm, prompt: str, max_tokens: int, temperature: float, top_p: float, top_k: int, seed: int,
            ran: list | None = None) -> Iterator[str]:
    n_ctx = getattr(llm, "mfgguf_n_ctx", llm.n_ctx())
    n_prompt = len(llm.tokenize(prompt.encode("utf-8"), add_bos=True))
    if n_prompt >= n_ctx:
        raise MfggufError(f"the prompt is {n_prompt} tokens, the model's context is {n_ctx}; shorten the prompt")
    max_tokens = min(max_tokens, n_ctx - n_prompt)  # stay inside the trained context
    llm.reset()  # the same seed gives the same text whatever ran before
    for chunk in llm.create_completion(prompt, max_tokens=max_tokens, temperature=temperature, top_p=top_p,
                                       top_k=top_k, min_p=0.0, seed=seed, stream=True):
        yield chunk["choices"][0]["text"]
    if ran is not None:  # the prompt's and the reply's tokens as the model ran them (the last one sampled, not run)
        ran[:] = [int(t) for t in llm.input_ids[: llm.n_tokens]]


def generate(
    model,
    prompt: str,
    *,
    max_tokens: int = 128,
    temperature: float = 0.8,
    top_p: float = 0.95,
    top_k: int = 40,
    seed: int = 0,
    stream: bool = False,
    n_ctx: int | None = None,
    experts_per_token: int | None = None,
    ran: list | None = None,
) -> str | Iterator[str]:
    """Continue PROMPT with the model and print only the generated text (same seed, same text).

    MODEL is a GGUF path or an open llama_cpp.Llama. Generation stops at the end-of-text token,
    after max_tokens, or at the end of the model's context. temperature 0 is greedy decoding.
    With stream=True, returns an iterator of text pieces as they are produced. --experts-per-token K routes
    each token to K experts instead of the file's own count (llama.cpp's metadata override); --show-experts
    prints on stderr which experts the prompt and the text went through (`mfgguf route`'s table).

    Example:
        >>> generate("model.gguf", "def main(", max_tokens=64, temperature=0.7, seed=42)
    """
    check_sampling(max_tokens, temperature, top_p, top_k)
    if isinstance(model, (str, Path)):
        if stream:
            return _stream_from_path(Path(model), prompt, max_tokens, temperature, top_p, top_k, seed, n_ctx,
                                     experts_per_token, ran)
        with loaded(model, n_ctx=n_ctx, seed=seed, experts_per_token=experts_per_token) as llm:
            return "".join(_stream(llm, prompt, max_tokens, temperature, top_p, top_k, seed, ran))
    pieces = _stream(model, prompt, max_tokens, temperature, top_p, top_k, seed, ran)
    return pieces if stream else "".join(pieces)


def _stream_from_path(path, prompt, max_tokens, temperature, top_p, top_k, seed, n_ctx,
                      experts_per_token=None, ran=None) -> Iterator[str]:
    # closed when the iterator ends or is closed
    with loaded(path, n_ctx=n_ctx, seed=seed, experts_per_token=experts_per_token) as llm:
        yield from _stream(llm, prompt, max_tokens, temperature, top_p, top_k, seed, ran)
