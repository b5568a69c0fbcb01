"""Multiple-choice tasks scored through llama-cpp-python exactly as llama.cpp's `llama-perplexity` scores them.

The same context (n_parallel sequences of `ctx` tokens in one unified KV cache, llama-perplexity's
`-np max(4, N)`; its batch and micro-batch; flash attention as llama.cpp decides on its own), the same batches
(as many tasks as fit its context and sequences; a candidates' common prefix once, shared by their sequences,
then each candidate's own tokens), the same scores:
  - HellaSwag and the multiple-choice format: a candidate's mean log-probability over its tokens after the
    common prefix, the first of them from the prefix's last logits; the highest wins, the first of equals;
  - WinoGrande: the mean log-probability of the words after the blank (the option's own tokens too when fewer
    than four tokens follow the prefix), the last token left out, as llama-perplexity computes it.
So a task's verdict is llama-perplexity's, and a test holds the two to it on every task of a file.

`Engine` also switches LoRA adapters between tasks: `choose_adapters` scores each task's common prefix (its
context) under every candidate adapter and the base, and the task is then scored through the lowest (the rule of
eval/domain_stream.py, where a document's opening picks its adapter).

Example:
    >>> with engine(Path("model.gguf"), ctx=512, threads=2) as e:
    ...     scores = score_tasks(e, "hellaswag", tasks)
"""

from __future__ import annotations

import ctypes
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

from mfgguf.errors import MfggufError
from mfgguf.runtime.choice.tasks import Task

N_PARALLEL = 4  # llama-perplexity's least -np for its benchmarks: the sequences of one HellaSwag task
SEQ_CAP = {"hellaswag": 4 * 32, "multiple-choice": 4 * 32, "winogrande": 2 * 128}  # its sequences a batch at most
MIN_TRAILING = 3  # WinoGrande: more tokens than this after the prefix and the option itself goes unscored
_SIZE_T = 1 << 64  # WinoGrande's token counts are size_t there


@dataclass
class Engine:
    """A loaded model, one context shaped like llama-perplexity's, and the adapters it may switch between."""

    model: object  # llama_cpp._internals.LlamaModel
    ctx: object  # llama_cpp._internals.LlamaContext
    n_batch: int
    adapters: dict[str, object] = field(default_factory=dict)  # name -> llama_adapter_lora_p
    current: str | None = None

    @property
    def n_ctx(self) -> int:
        import llama_cpp

        return llama_cpp.llama_n_ctx(self.ctx.ctx)

    @property
    def n_seq(self) -> int:
        import llama_cpp

        return llama_cpp.llama_n_seq_max(self.ctx.ctx)

    def tokenize(self, text: str) -> list[int]:
        return self.model.tokenize(text.encode("utf-8"), add_bos=True, special=False)  # common_tokenize(.., true)

    def use(self, adapter: str | None) -> None:
        """Apply adapter `adapter` at scale 1 (None: none) to what is decoded next."""
        import llama_cpp

        if adapter == self.current:
            return
        if adapter is None:
            llama_cpp.llama_set_adapters_lora(self.ctx.ctx, None, 0, None)
        else:
            ptrs = (llama_cpp.llama_adapter_lora_p_ctypes * 1)(self.adapters[adapter])
            if llama_cpp.llama_set_adapters_lora(self.ctx.ctx, ptrs, 1, (ctypes.c_float * 1)(1.0)):
                raise MfggufError(f"llama.cpp could not apply the LoRA adapter {adapter}; pass one of this model")
        self.current = adapter

    def decode(self, entries: list[tuple[int, int, tuple[int, ...], bool]]) -> np.ndarray:
        """(outputs, vocab) logits of one batch of (token, position, sequences, wants logits) from an empty cache,
        decoded n_batch entries at a time as llama-perplexity's decode_helper does."""
        import llama_cpp

        n_vocab = self.model.n_vocab()
        llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(self.ctx.ctx), True)
        rows = []
        batch = llama_cpp.llama_batch_init(self.n_batch, 0, max(len(e[2]) for e in entries))
        try:
            for b0 in range(0, len(entries), self.n_batch):
                part = entries[b0: b0 + self.n_batch]
                for j, (tok, pos, seqs, out) in enumerate(part):
                    batch.token[j], batch.pos[j], batch.n_seq_id[j], batch.logits[j] = tok, pos, len(seqs), out
                    for k, s in enumerate(seqs):
                        batch.seq_id[j][k] = s
                batch.n_tokens = len(part)
                if llama_cpp.llama_decode(self.ctx.ctx, batch) != 0:
                    raise MfggufError("llama.cpp failed to decode a batch of benchmark tasks; pass a smaller --ctx")
                n_out = sum(e[3] for e in part)
                if n_out:
                    ptr = llama_cpp.llama_get_logits(self.ctx.ctx)
                    rows.append(np.ctypeslib.as_array(ptr, shape=(n_out * n_vocab,)).reshape(n_out, n_vocab).copy())
        finally:
            llama_cpp.llama_batch_free(batch)
        return np.concatenate(rows) if rows else np.zeros((0, n_vocab), np.float32)


@contextmanager
def engine(model: Path, *, ctx: int, batch: int, threads: int | None = None, n_parallel: int = N_PARALLEL,
           adapters: dict[str, Path] | None = None, overrides: dict[str, int] | None = None):
    """An `Engine` on MODEL for a `with` block: llama-perplexity's context for `-c ctx -b batch -np n_parallel`
    (n_parallel sequences of ctx tokens in one unified cache), every adapter in `adapters` loaded (none applied
    until `use`), integer metadata `overrides` applied as llama-perplexity's `--override-kv KEY=int:V`."""
    from mfgguf.runtime.context import llama_context

    with llama_context(model, n_ctx=n_parallel * ctx, n_batch=batch, n_seq=n_parallel, kv_unified=True,
                       threads=threads, adapters=adapters, overrides=overrides) as lc:
        yield Engine(lc.model, lc.ctx, lc.n_batch, lc.adapters)


@dataclass
class _Tokens:
    seqs: list[list[int]]  # each candidate's tokens
    prefix: int  # tokens every candidate shares
    bases: list[int]  # WinoGrande: tokens of each candidate's text up to its option

    @property
    def required(self) -> int:
        return self.prefix + sum(len(s) - self.prefix for s in self.seqs)


def tokenize(e: Engine, tasks: list[Task]) -> list[_Tokens]:
    out = []
    for t in tasks:
        seqs = [e.tokenize(c) for c in t.candidates]
        n = 0
        while n < min(map(len, seqs)) and all(s[n] == seqs[0][n] for s in seqs[1:]):
            n += 1
        out.append(_Tokens(seqs, n, [len(e.tokenize(b)) for b in t.bases]))
    return out


def score_tasks(e: Engine, benchmark: str, tasks: list[Task], toks: list[_Tokens] | None = None,
                progress: Callable[[list[list[float]]], None] | None = None) -> list[list[float]]:
    """Each task's candidate scores, as llama-perplexity computes them (the highest is its answer);
    `progress(scores so far)` after each batch."""
    toks = toks if toks is not None else tokenize(e, tasks)
    max_seq = min(SEQ_CAP[benchmark], e.n_seq)
    if any(len(t.seqs) > max_seq for t in toks):
        raise MfggufError(f"a {benchmark} task has {max(len(t.seqs) for t in toks)} answers, more than the"
                          f" {max_seq} sequences of the context; it needs n_parallel of at least that")
    scores: list[list[float]] = []
    i0 = 0
    while i0 < len(toks):
        entries, starts, n_cur, s0, i1 = [], [], 0, 0, i0
        while i1 < len(toks) and n_cur + toks[i1].required <= e.n_ctx and s0 + len(toks[i1].seqs) <= max_seq:
            starts.append(sum(o for *_, o in entries))
            entries += _entries(toks[i1], s0, all_outputs=benchmark == "winogrande")
            n_cur, s0, i1 = n_cur + toks[i1].required, s0 + len(toks[i1].seqs), i1 + 1
        if i1 == i0:
            raise MfggufError(f"a {benchmark} task needs {toks[i0].required} tokens, more than the context's"
                              f" {e.n_ctx}; pass a larger --ctx")
        logits = e.decode(entries)  # (outputs, vocab)
        for t, r0 in zip(toks[i0:i1], starts):
            scores.append(_winogrande(logits, t, r0) if benchmark == "winogrande" else _continuation(logits, t, r0))
        i0 = i1
        if progress is not None:
            progress(scores)
    return scores


def _entries(t: _Tokens, s0: int, all_outputs: bool) -> list[tuple[int, int, tuple[int, ...], bool]]:
    """One task's batch entries: its common prefix once (logits at its last token only), then each candidate's
    tokens after it (logits at all but its last, or at all of them for WinoGrande), sequences s0, s0 + 1, ..."""
    seqs = tuple(range(s0, s0 + len(t.seqs)))
    out = [(t.seqs[0][i], i, seqs, i == t.prefix - 1) for i in range(t.prefix)]
    for s, seq in enumerate(t.seqs):
        out += [(seq[i], i, (s0 + s,), all_outputs or i < len(seq) - 1) for i in range(t.prefix, len(seq))]
    return out


def _log_softmax_at(rows: np.ndarray, targets) -> np.ndarray:
    """log p(target) of each row of logits: the row's max subtracted, the exponentials summed in float64."""
    rows = rows.astype(np.float32, copy=False)
    m = rows.max(axis=1, keepdims=True)  # (k, 1)
    z = np.log(np.exp(rows - m).sum(axis=1, dtype=np.float64))  # (k,)
    return rows[np.arange(len(rows)), targets] - m[:, 0] - z


def _continuation(logits: np.ndarray, t: _Tokens, r0: int) -> list[float]:
    """HellaSwag's and the multiple-choice format's score of each candidate (perplexity.cpp, hellaswag_score)."""
    first = logits[r0].astype(np.float32)
    p = np.exp(first - first.max())  # (vocab,) float32
    probs = (p / p.sum(dtype=np.float64)).astype(np.float32)  # softmax() there: float probabilities
    out, li = [], r0 + 1
    for seq in t.seqs:
        rest = seq[t.prefix + 1:]  # tokens predicted by the candidate's own positions
        lp = _log_softmax_at(logits[li: li + len(rest)], rest) if rest else np.zeros(0)
        li += len(rest)
        out.append(float((np.log(np.float64(probs[seq[t.prefix]])) + lp.sum(dtype=np.float64)) / (1 + len(rest))))
    return out


def _winogrande(logits: np.ndarray, t: _Tokens, r0: int) -> list[float]:
    """WinoGrande's score of each of the two candidates (perplexity.cpp, winogrande_score), its row arithmetic too."""
    (n0, n1), cp = map(len, t.seqs), t.prefix
    skip = n0 - cp > MIN_TRAILING and n1 - cp > MIN_TRAILING
    out = []
    for s, (seq, n) in enumerate(zip(t.seqs, (n0, n1))):
        base = t.bases[s] if skip else cp
        last = 1 if (n - base) % _SIZE_T > 1 else 0  # size_t arithmetic there, a negative difference wrapping
        li = base - cp if s == 0 else n0 - cp + base - cp
        js = list(range(base - 1, n - 1 - last))
        lp = _log_softmax_at(logits[r0 + li: r0 + li + len(js)], [seq[j + 1] for j in js]) if js else np.zeros(0)
        with np.errstate(divide="ignore", invalid="ignore"):  # C++'s float division, a zero count included
            out.append(float(np.float32(lp.sum(dtype=np.float64)) / np.float32((n - base - last) % _SIZE_T)))
    return out


def verdicts(benchmark: str, tasks: list[Task], scores: list[list[float]]) -> list[int]:
    """1 where the task's answer (its highest score, the first of equals) is right, else 0."""
    out = []
    for t, s in zip(tasks, scores):
        if benchmark == "winogrande":
            pick = 0 if s[0] > s[1] else 1  # `score_1st > score_2nd ? 1 : 2` there: a NaN picks the second
        else:
            pick = int(np.argmax(np.asarray(s, dtype=np.float64)))
        out.append(int(pick in t.right))
    return out


def choose_adapters(e: Engine, toks: list[_Tokens], names: list[str | None]) -> tuple[list[int], np.ndarray]:
    """Each task's candidate (an index into `names`, None the base) of lowest NLL on its common prefix, the first of
    equals; and the (tasks, candidates) NLL sums. A prefix of one token reads nothing and keeps the first."""
    nll = np.zeros((len(toks), len(names)))
    groups, at = [], 0  # tasks decoded together: a sequence each, their prefixes within the context
    while at < len(toks):
        end, n = at, 0
        while end < len(toks) and end - at < e.n_seq and (end == at or n + toks[end].prefix <= e.n_ctx):
            n, end = n + toks[end].prefix, end + 1
        groups.append(range(at, end))
        at = end
    for j, name in enumerate(names):
        e.use(name)
        for group in groups:
            entries = [(toks[i].seqs[0][p], p, (s,), p < toks[i].prefix - 1)
                       for s, i in enumerate(group) for p in range(toks[i].prefix)]
            if not any(o for *_, o in entries):
                continue
            logits, r = e.decode(entries), 0
            for i in group:
                t, k = toks[i], max(toks[i].prefix - 1, 0)
                if k:
                    nll[i, j] = -float(_log_softmax_at(logits[r: r + k], t.seqs[0][1: t.prefix]).sum(dtype=np.float64))
                r += k
    return nll.argmin(axis=1).tolist(), nll


__all__ = ["Engine", "N_PARALLEL", "choose_adapters", "engine", "score_tasks", "tokenize", "verdicts"]
