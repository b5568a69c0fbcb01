"""Perplexity computed by llama.cpp, windowed exactly like llama.cpp's `llama-perplexity` tool.

The tokens are cut into consecutive windows of `ctx` tokens (a tail shorter than a window is
dropped). Each window is evaluated from an empty KV cache, and only its second half is scored:
the logits at positions ctx/2 .. ctx-2 predict tokens ctx/2+1 .. ctx-1, so every scored token
sees at least ctx/2 tokens of context. As in llama.cpp, the first token of a window is replaced
by BOS when the model's tokenizer adds one, and attention is llama.cpp's flash attention, which
llama-perplexity turns on by itself on a CPU. NLL is accumulated in float64. Only the scored
positions' logits are asked of llama.cpp, one batch of at most 512 at a time, so memory stays near
the model's own size at any window (a long window at a large vocabulary would otherwise hold gigabytes
of logits).

`document_nll` scores documents one by one instead (a choice per document: eval/domain_stream.py): each
from an empty KV cache, every token after its first, in windows of ctx that overlap by half.

Example:
    >>> from mfgguf.runtime.perplexity import perplexity
    >>> perplexity("model.gguf", tokens)["ppl"]
"""

from __future__ import annotations

import math
import time
from pathlib import Path

import numpy as np

from mfgguf.data.masks import split_masks
from mfgguf.errors import MfggufError
from mfgguf.run import RunDir
from mfgguf.runtime.llm import check_ctx, loaded


BATCH = 512  # tokens per llama_decode call: llama.cpp's default batch; at most this many rows of logits exist
ROWS = 64  # logits rows reduced at a time (a row is n_vocab floats)
WINDOW = 1024  # default window (--ctx), or the model's trained context where that is shorter: an imported
# base's 8,192 would cost more per token in attention (docs/memory.md) and score nothing on a domain of fewer tokens


def windows(n_tokens: int, ctx: int) -> list[tuple[int, int]]:
    """(start, end) of each evaluated window; a tail shorter than `ctx` is not scored."""
    return [(s, s + ctx) for s in range(0, n_tokens - ctx + 1, ctx)]


def scored_span(ctx: int) -> tuple[int, int]:
    """Window positions whose logits are scored: [first, ctx-1), predicting tokens first+1 .. ctx-1."""
    return ctx // 2, ctx - 1


def _as_tokens(tokens, n_vocab: int, what: str) -> np.ndarray:
    t = np.asarray(tokens)
    if t.ndim != 1 or (t.size and not np.issubdtype(t.dtype, np.integer)):
        raise MfggufError(f"{what}: expected a 1-D array of token ids, got shape {t.shape} of {t.dtype}")
    if t.size == 0:
        raise MfggufError(f"{what} has no tokens; pass non-empty data")
    if t.min() < 0 or t.max() >= n_vocab:
        raise MfggufError(
            f"{what} holds token id {int(t.max())} but the model's vocabulary has {n_vocab};"
            " the data was tokenized with a different tokenizer than this GGUF's"
        )
    return t.astype(np.int64)


def _nll_of_window(llm, window: np.ndarray, bos: int | None, span: tuple[int, int] | None = None,
                   out: np.ndarray | None = None) -> tuple[float, int]:
    """Sum of -log p over the scored positions of one window, and how many tokens that is.

    `span` is [first, last) of the window's positions whose logits are scored (default `scored_span`, the
    second half); `out`, where given, receives each scored token's NLL in order (last - first of them).
    The window goes through llama.cpp in batches of the context's n_batch tokens, and each batch asks
    for the logits of its scored positions only; they are reduced to NLL before the next batch runs.
    So at most n_batch x n_vocab logits exist at a time, whatever the window (all logits of one
    long window at a large vocabulary would be gigabytes).
    """
    ids = window.tolist()
    if bos is not None:
        ids[0] = bos  # what llama-perplexity does when the vocab adds a BOS
    first, last = span or scored_span(len(ids))
    ctx, batch, V = llm._ctx, llm._batch, llm.n_vocab()
    llm.reset()
    ctx.kv_cache_clear()  # the window starts from an empty KV cache
    nll, n = 0.0, 0
    for b0 in range(0, len(ids), llm.n_batch):
        chunk = ids[b0 : b0 + llm.n_batch]
        lo, hi = max(first - b0, 0), min(last - b0, len(chunk))  # this batch's scored positions: [lo, hi)
        batch.set_batch(batch=chunk, n_past=b0, logits_all=False)
        for j in range(lo, hi):
            batch.batch.logits[j] = True  # set_batch flags only the last token; its row comes after these
        ctx.decode(batch)
        if hi <= lo:
            continue
        logits = np.ctypeslib.as_array(ctx.get_logits(), shape=((hi - lo) * V,)).reshape(hi - lo, V)  # (k, V) no copy
        targets = window[b0 + lo + 1 : b0 + hi + 1]  # (k,)
        for r in range(0, hi - lo, ROWS):  # numpy's temporaries stay at ROWS x V
            x, t = logits[r : r + ROWS], targets[r : r + ROWS]  # (rows, V), (rows,)
            m = x.max(axis=1, keepdims=True)  # (rows, 1)
            logz = m[:, 0].astype(np.float64) + np.log(np.exp(x - m).sum(axis=1, dtype=np.float64))  # (rows,)
            tok = logz - x[np.arange(len(t)), t]  # (rows,) float64
            if out is not None:
                out[b0 + lo + r - first : b0 + lo + r - first + len(t)] = tok
            nll += float(tok.sum())
        n += hi - lo
    llm.reset()
    return nll, n


def _perplexity_llm(llm, tokens, ctx: int, what: str = "the data", progress=None, eos: int | None = None,
                    mask=None) -> dict:
    t = _as_tokens(tokens, llm.n_vocab(), what)
    if len(t) < ctx:
        raise MfggufError(f"{what} has {len(t)} tokens; perplexity with --ctx {ctx} needs at least {ctx} (one window); pass more data or a smaller --ctx")
    if mask is not None and len(mask) < len(t):
        raise MfggufError(f"{what}: its loss mask has {len(mask)} entries for {len(t)} tokens; re-create the run with"
                          " `mfgguf prepare`")
    bos = llm.token_bos() if llm._model.add_bos_token() else None
    nll, n, t0 = 0.0, 0, time.perf_counter()
    spans = windows(len(t), ctx)
    first, last = scored_span(ctx)
    per_doc = eos is not None
    if per_doc:
        doc_of = np.concatenate([[0], np.cumsum(t == eos)])  # (len+1,) EOS tokens before each index: its document
        doc_nll, doc_n = np.zeros(len(t) + 1), np.zeros(len(t) + 1, dtype=np.int64)  # per document, by its index
    for s, e in spans:
        tok = np.zeros(last - first) if per_doc or mask is not None else None  # (scored,) nats per scored token
        w_nll, w_n = _nll_of_window(llm, t[s:e], bos, out=tok)
        # a conversation's context turns are read, not scored: only targets its mask counts (data/masks.py)
        counted = np.ones(last - first, bool) if mask is None else np.asarray(mask[s + first + 1: s + last + 1]) != 0
        if mask is not None:
            w_nll, w_n = float(tok[counted].sum()), int(counted.sum())
        nll, n = nll + w_nll, n + w_n
        if per_doc:
            ids = doc_of[s + first + 1 : s + last + 1]  # the document of each predicted token (an EOS ends its own)
            np.add.at(doc_nll, ids[counted], tok[counted])
            np.add.at(doc_n, ids[counted], 1)
        if progress is not None and n:
            progress(e - s, nll / n)
    if n == 0:
        raise MfggufError(f"{what}: its loss mask counts none of the scored tokens; pass a split with assistant turns"
                          " or a larger --ctx")
    seconds = time.perf_counter() - t0
    docs = {"documents": [[float(doc_nll[i]), int(doc_n[i])] for i in np.flatnonzero(doc_n)]} if per_doc else {}
    return {
        "ppl": math.exp(nll / n),
        "nll": nll / n,  # mean negative log-likelihood, nats per scored token
        "n_tokens": n,  # scored tokens
        "n_windows": len(spans),
        "ctx": ctx,
        "n_input_tokens": int(len(t)),
        "tokens_per_s": len(spans) * ctx / seconds if seconds > 0 else None,  # evaluated (prompt) tokens
        **docs,  # with `eos`: [NLL sum, scored tokens] of each document scored, in order (eval/spread.py resamples them)
    }


def _open(model, ctx: int | None, batch: int | None, threads: int | None, lora: Path | None = None,
          experts_per_token: int | None = None):
    """(context manager, ctx) for a path; an open Llama is used as is."""
    from contextlib import nullcontext

    if isinstance(model, (str, Path)):
        from mfgguf.runtime.llm import read_header

        header = read_header(model)
        ctx = check_ctx(header, ctx or min(WINDOW, header["context_length"]))
        # flash attention, as llama-perplexity has it on a CPU: the windows are long, where it pays (docs/front-ends.md)
        return loaded(model, n_ctx=ctx, n_batch=min(batch or BATCH, ctx), threads=threads, lora=lora,
                      flash_attn=True, experts_per_token=experts_per_token), ctx
    ctx = check_ctx(model.mfgguf_header, ctx or getattr(model, "mfgguf_n_ctx", None))
    if ctx > model.n_ctx():
        raise MfggufError(f"--ctx {ctx} is longer than the open model's context {model.n_ctx()}; reopen it with n_ctx={ctx}")
    return nullcontext(model), ctx


def perplexity(model, tokens, *, ctx: int | None = None, batch: int | None = None, threads: int | None = None,
               lora: Path | None = None, experts_per_token: int | None = None, mask=None) -> dict:
    """Perplexity of a token sequence under a GGUF, computed by llama.cpp.

    MODEL is a GGUF path (or an open Llama). ctx defaults to 1,024 tokens, or the model's trained
    context where that is shorter. Returns {"ppl", "nll" (mean nats per scored token), "n_tokens"
    (scored), "n_windows", "ctx", "n_input_tokens", "tokens_per_s"}. MASK (data/masks.py, one entry a token)
    scores only the tokens it counts.

    Example:
        >>> perplexity("model.gguf", np.load("RUN/data/test/code.npy"), ctx=128)
    """
    cm, ctx = _open(model, ctx, batch, threads, lora, experts_per_token)
    with cm as llm:
        return _perplexity_llm(llm, tokens, ctx, mask=mask)


def perplexity_by_domain(model, domains: dict, *, ctx: int | None = None, batch: int | None = None,
                         threads: int | None = None, progress: bool = False, lora: Path | None = None,
                         eos: int | None = None, experts_per_token: int | None = None,
                         masks: dict | None = None) -> dict:
    """Perplexity per domain and overall (token-weighted mean NLL) with one load of the model.

    `domains` maps a name to token ids. Returns {"domains": {name: result}, "overall": {...}}
    where each result is what `perplexity` returns. With `eos` (the token that ends a document), each domain's result
    also lists every scored document's [NLL sum, scored tokens], so a figure's spread over documents can be drawn.
    `masks` maps a domain to its loss mask (data/masks.py: 1 where a token counts): a conversation's domain is scored
    on its assistant turns alone, as it was trained; a domain without one counts every token.

    Example:
        >>> r = perplexity_by_domain("model.gguf", {"code": a, "prose": b})
        >>> r["overall"]["ppl"], r["domains"]["code"]["ppl"]
    """
    cm, ctx = _open(model, ctx, batch, threads, lora, experts_per_token)
    with cm as llm:
        return _by_domain_llm(llm, domains, ctx, progress, eos, masks)


def _by_domain_llm(llm, domains: dict, ctx: int, progress: bool, eos: int | None = None,
                   masks: dict | None = None) -> dict:
    if not domains:
        raise MfggufError("no data to score; pass at least one domain of tokens")
    out = {}
    with _progress_bar(progress, domains, ctx) as bar:
        for name, toks in domains.items():
            out[name] = _perplexity_llm(llm, toks, ctx, what=f"domain {name!r}", progress=bar(name), eos=eos,
                                        mask=(masks or {}).get(name))
    n = sum(r["n_tokens"] for r in out.values())
    nll = sum(r["nll"] * r["n_tokens"] for r in out.values()) / n
    n_windows = sum(r["n_windows"] for r in out.values())
    secs = sum(r["n_windows"] * ctx / r["tokens_per_s"] for r in out.values() if r["tokens_per_s"])
    overall = {
        "ppl": math.exp(nll), "nll": nll, "n_tokens": n, "n_windows": n_windows, "ctx": ctx,
        "n_input_tokens": sum(r["n_input_tokens"] for r in out.values()),
        "tokens_per_s": n_windows * ctx / secs if secs else None,
    }
    return {"domains": out, "overall": overall}


def document_windows(n_tokens: int, ctx: int) -> list[tuple[int, int, int]]:
    """(start, end, first) of each window over one document of `n_tokens`, scoring every token after its first.

    The positions [first, end - 1) are scored, each predicting the next token. The first window is the
    document's first `ctx` tokens, every position scored: a token sees its document's whole prefix and
    nothing before it. Each later window starts ctx/2 positions before its first scored one, so (as in
    `windows`, llama-perplexity's) every token it scores sees at least ctx/2 + 1 tokens, and it scores
    the ctx - 1 - ctx/2 tokens after the previous window's. A document's windows depend only on ctx, so a
    document's prefix gets the prefix of its windows: its first tokens score the same alone as inside it.
    """
    if ctx - 1 - ctx // 2 < 1:
        raise MfggufError(f"--ctx {ctx} is too small to score documents window by window; pass --ctx 3 or more")
    if n_tokens < 2:
        return []
    spans = [(0, min(n_tokens, ctx), 0)]
    while spans[-1][1] < n_tokens:
        first = spans[-1][1] - 1  # predicts the first token the last window did not
        start = first - ctx // 2
        spans.append((start, min(start + ctx, n_tokens), first))
    return spans


def document_nll(model, documents: list, *, ctx: int | None = None, batch: int | None = None,
                 threads: int | None = None, lora: Path | None = None, first: int | None = None
                 ) -> tuple[list[np.ndarray], int]:
    """Each document's per-token NLL under MODEL (with `lora` applied), every document from an empty KV cache.

    A document is scored from its second token on: its first token is its only context (a separator such
    as the previous document's EOS, replaced by BOS where the vocab adds one, as every window's first
    token is here), and its windows are `document_windows`. `first` scores only the first `first` tokens
    after it (what a choice made on a document's opening reads). One load of the model for all of them.
    Returns ([(len(doc) - 1,) float64 nats per scored token, per document], the ctx used).

    Example:
        >>> nll, ctx = document_nll("base.gguf", [np.array([eos, 17, 4, 99, eos])], ctx=64, lora=Path("lora.gguf"))
    """
    cm, ctx = _open(model, ctx, batch, threads, lora)
    out = []
    with cm as llm:
        bos = llm.token_bos() if llm._model.add_bos_token() else None
        for i, doc in enumerate(documents):
            t = _as_tokens(doc, llm.n_vocab(), f"document {i}")
            t = t[: first + 1] if first is not None else t
            nll = np.zeros(max(len(t) - 1, 0))  # (n - 1,) one per predicted token
            for s, e, f in document_windows(len(t), ctx):
                _nll_of_window(llm, t[s:e], bos, span=(f - s, e - 1 - s), out=nll[f : e - 1])
            out.append(nll)
    return out, ctx


def perplexity_files(model: Path, *, data: list[Path] | None = None, run: Path | None = None, ctx: int | None = None,
                     batch: int | None = None, threads: int | None = None, progress: bool = True,
                     lora: Path | None = None, chunks: int | None = None, experts_per_token: int | None = None) -> dict:
    """Perplexity of MODEL, computed by llama.cpp, on text files or on a RUN's held-out split.

    With --data FILE (repeatable) each file is UTF-8 text tokenized by the GGUF's own tokenizer
    and scored as one domain named after the file. With --run RUN each RUN/data/test/<domain>.npy
    is one domain. Windows of --ctx tokens (default 1,024, or the model's trained context where
    that is shorter; at most the trained context), each evaluated fresh with its second half
    scored, as llama.cpp's perplexity tool does. Reports every domain with its token counts and
    the token-weighted overall figure. --lora ADAPTER scores MODEL with a llama.cpp LoRA adapter
    applied (the lora.gguf `train-base --mode lora` writes, on the base's dense GGUF). --chunks N
    scores only each domain's first N windows, as llama.cpp's perplexity tool's --chunks: a quick
    look, where the whole split is the figure to report. --experts-per-token K routes each token to K
    experts instead of the file's own count (llama.cpp's metadata override; the file is not rewritten).

    --hellaswag FILE, --winogrande FILE and --multiple-choice FILE score llama.cpp's multiple-choice
    benchmarks instead (or as well, with --data or --run): the tasks llama-perplexity draws for the
    task count given (--hellaswag-tasks N; 400 by default, as there), each candidate scored by its
    length-normalised log-likelihood as llama-perplexity scores it, by llama-perplexity itself where
    `make llama-tools` built it and by llama-cpp-python otherwise (--engine). Reports the accuracy with
    its interval; --out FILE.json keeps it with every task's verdict, to compare two models task
    by task. The user names the file: nothing is downloaded.

    Example:
        >>> perplexity_files("model.gguf", run="RUN", ctx=128)["overall"]["ppl"]
    """
    if (data is None) == (run is None) or (data is not None and not data):
        raise MfggufError("pass either --data FILE or --run RUN (one of the two)")
    if chunks is not None and chunks < 1:
        raise MfggufError(f"--chunks {chunks}: pass a number of windows of at least 1, or leave it out to score everything")
    masks = None
    if run is not None:
        domains = RunDir(run).test_tokens()
        masks = split_masks(RunDir(run).test_dir, domains)
    else:
        texts = {}
        for f in map(Path, data):
            if not f.is_file():
                raise MfggufError(f"data file not found: {f}")
            text = f.read_text(encoding="utf-8", errors="replace")
            if not text.strip():
                raise MfggufError(f"data file {f} is empty; pass a file with text to score")
            texts[f.stem] = text
    cm, ctx = _open(model, ctx, batch, threads, lora, experts_per_token)
    with cm as llm:
        if data is not None:  # the GGUF's own tokenizer, run by llama.cpp
            domains = {k: np.asarray(llm.tokenize(v.encode("utf-8"), add_bos=False, special=False)) for k, v in texts.items()}
        if chunks is not None:  # whole windows only: what follows the N-th is not read
            domains = {k: v[: chunks * ctx] for k, v in domains.items()}
        return _by_domain_llm(llm, domains, ctx, progress, masks=masks)


def _progress_bar(enabled: bool, domains: dict, ctx: int):
    """A rich bar over evaluated tokens (tokens/s, running perplexity, ETA); no-op when disabled."""
    from contextlib import contextmanager

    @contextmanager
    def bar():
        if not enabled:
            yield lambda name: None
            return
        from rich.console import Console
        from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

        total = sum((len(t) // ctx) * ctx for t in domains.values())
        cols = (TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total} tok"),
                TextColumn("{task.fields[rate]} tok/s  ppl {task.fields[ppl]}"), TimeRemainingColumn())
        with Progress(*cols, transient=True, console=Console(stderr=True)) as p:  # stdout stays clean
            task = p.add_task("perplexity", total=total, rate="-", ppl="-")
            t0 = time.perf_counter()

            def for_domain(name):
                def step(n, mean_nll):
                    p.advance(task, n)
                    done = p.tasks[0].completed
                    p.update(task, description=name, rate=f"{done / (time.perf_counter() - t0):.0f}",
                             ppl=f"{math.exp(mean_nll):.2f}")
                return step

            yield for_domain

    return bar()
