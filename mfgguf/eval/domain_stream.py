"""Per-domain adapters when the client does not know the domain: each document picks one by its opening tokens.

The oracle (eval/domain_loras.py) serves each domain's text with its own adapter. A client that gets a
document of unknown domain can do what this measures instead: score the document's first
`choose_tokens` (128) tokens under every candidate -- the base alone and the base with each adapter --
and serve the document with the one of lowest loss there. The model assembled from experts needs no
such choice (its router picks per token), so it is the single candidate on the same documents.

What is scored. A split's tokens per domain are documents, each followed by EOS (data/prepare.py
`write_tokens`); a document is scored from an empty KV cache with the EOS before it as its only context
(a synthetic one for a split's first document; BOS in its place where the vocab adds one), every token of
it and its own EOS, in windows of ctx that overlap by half (runtime/perplexity.py `document_windows`).
So each split token is scored once, and no token sees another document. Two figures are reported:
  - overall: every token, each document by its chosen candidate. The choice read the first
    `choose_tokens` tokens and took the lowest loss on them, so on those tokens it is a minimum over
    candidates: a leak in the adapters' favour (a stricter bar for the MoE);
  - after_choice: only the tokens after each document's first `choose_tokens`, which the choice never
    saw: what the served continuation of a 128-token opening costs. This is the honest comparison.
A document of at most `choose_tokens` tokens (its EOS counted) is chosen on all of them; it counts in
overall and not at all in after_choice. Ties go to the earlier candidate (the base first).

Cost: a first pass loads each candidate once and scores every document's opening (candidates x
choose_tokens a document); a second loads each chosen candidate once more and scores only the documents
that chose it (each document in full once). One Llama is alive at a time.

Example:
    >>> candidates, own = stream_candidates({"python": "out/lora-shard1/lora.gguf", "c": "out/lora-shard2/lora.gguf"})
    >>> r = domain_stream(Path("trunk-f16.gguf"), rd.test_tokens(32768), candidates, eos=rd.run_info().eos_id, own=own)
    >>> r["after_choice"]["ppl"], r["own_choice"]
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from mfgguf.errors import MfggufError
from mfgguf.runtime.perplexity import document_nll

CHOOSE_TOKENS = 128  # the opening a document's adapter is chosen on (the "first 128 tokens")
BASE = "base"  # the candidate with no adapter


def split_documents(tokens, eos: int) -> list[np.ndarray]:
    """A split's documents as they are scored: the EOS before each (a synthetic one for the first), its tokens and
    its own EOS; a tail a cap cut short has no EOS of its own. Together they score every token of `tokens` once."""
    t = np.asarray(tokens, dtype=np.int64)  # (n,)
    ends = (np.flatnonzero(t == eos) + 1).tolist()  # one past each EOS
    bounds = [0, *ends, *([len(t)] if not ends or ends[-1] != len(t) else [])]
    return [np.concatenate(([eos], t[a:b])) for a, b in zip(bounds, bounds[1:]) if b > a]  # each (1 + b - a,)


def stream_candidates(adapters: dict[str, str], every=()) -> tuple[dict[str, str | None], dict[str, str]]:
    """({name: adapter path, the base first with None}, {domain: its own candidate}) from {domain: adapter path}
    and `every` adapter path (a cluster's adapter may be no domain's own, and is still a candidate).

    An adapter is named by the folder it lives in (the RUN `train-base` wrote, e.g. lora-shard1); a domain absent
    from `adapters` has the base as its own (what the oracle serves it)."""
    names = {a: Path(a).parent.name for a in dict.fromkeys([*adapters.values(), *every])}
    if len(set(names.values())) < len(names):
        raise MfggufError(f"two adapters share a folder name ({sorted(names.values())}); keep each lora.gguf in a"
                          " folder of its own")
    if BASE in names.values():
        raise MfggufError(f"an adapter's folder is named {BASE!r}, the base's own name here; rename the folder")
    return {BASE: None, **{n: a for a, n in names.items()}}, {d: names[a] for d, a in adapters.items()}


def domain_stream(model: Path, tokens: dict, candidates: dict[str, str | Path | None], *, eos: int,
                  own: dict[str, str] | None = None, choose_tokens: int = CHOOSE_TOKENS, ctx: int | None = None,
                  threads: int | None = None) -> dict:
    """Each document of `tokens` ({domain: split tokens}) scored by the candidate of lowest NLL on its opening.

    `candidates` maps a name to a llama.cpp LoRA adapter applied to MODEL (None: MODEL alone), in the order
    ties go; one candidate is no choice (how the MoE is scored on the same documents). `own` maps a domain to the
    candidate that is its own (the base where it names none), for the share of its documents that chose it; `threads`
    are llama.cpp's (default: every CPU). Returns {"overall", "after_choice":
    {ppl, nll, n_tokens}, "domains": {d: {ppl, nll, n_tokens, documents, after_choice}}, "choice": {d: {candidate:
    documents}}, "own_choice": {d: share} (with `own`), "choose_tokens", "ctx", "candidates", "documents": [{domain,
    n_tokens, chosen, nll (summed), choice_nll: {candidate: summed NLL of the opening}}]}; figures as the module
    docstring says.
    """
    if not candidates:
        raise MfggufError("no candidate to score the documents with; pass the base (None) and its adapters")
    if choose_tokens < 1:
        raise MfggufError(f"choose_tokens {choose_tokens} reads nothing; pass 1 or more (the issue's 128)")
    docs = [(d, u) for d, t in tokens.items() for u in split_documents(t, eos)]
    if not docs:
        raise MfggufError("no documents to score; pass a split with tokens")
    units = [u for _, u in docs]
    names = list(candidates)
    lora = {c: Path(a) if a else None for c, a in candidates.items()}
    choice_nll = np.zeros((len(units), len(names)))  # (documents, candidates) summed NLL of each opening
    if len(names) > 1:
        for j, c in enumerate(names):
            opening, ctx = document_nll(model, units, ctx=ctx, threads=threads, lora=lora[c], first=choose_tokens)
            choice_nll[:, j] = [a.sum() for a in opening]
    chosen = choice_nll.argmin(axis=1)  # (documents,) the first of equal minima
    scored: list[np.ndarray | None] = [None] * len(units)
    for j, c in enumerate(names):
        mine = np.flatnonzero(chosen == j).tolist()
        if mine:
            nll, ctx = document_nll(model, [units[i] for i in mine], ctx=ctx, threads=threads, lora=lora[c])
            for i, a in zip(mine, nll):
                scored[i] = a  # (len(unit) - 1,)
    return _figures(docs, scored, names, chosen, choice_nll, own, choose_tokens, ctx)


def _figures(docs, scored, names, chosen, choice_nll, own, choose_tokens, ctx) -> dict:
    """The report's figures from each document's per-token NLL under its chosen candidate."""
    sums: dict[str, list[float]] = {}  # domain -> [nll, tokens, nll after the choice, tokens after it, documents]
    choice: dict[str, dict[str, int]] = {}
    for (d, _), a, j in zip(docs, scored, chosen):
        s = sums.setdefault(d, [0.0, 0, 0.0, 0, 0])
        after = a[choose_tokens:]  # (max(0, n - choose_tokens),) tokens the choice never read
        s[0] += float(a.sum()); s[1] += len(a); s[2] += float(after.sum()); s[3] += len(after); s[4] += 1
        counts = choice.setdefault(d, {c: 0 for c in names})
        counts[names[j]] += 1
    tot = np.sum(list(sums.values()), axis=0)  # (5,)
    out = {
        "overall": _fig(tot[0], int(tot[1])),
        "after_choice": _fig(tot[2], int(tot[3])),
        "domains": {d: {**_fig(s[0], s[1]), "documents": s[4], "after_choice": _fig(s[2], s[3])} for d, s in sums.items()},
        "choice": choice,
        "choose_tokens": choose_tokens,
        "ctx": ctx,
        "candidates": names,
        "documents": [{"domain": d, "n_tokens": len(a), "chosen": names[j], "nll": float(a.sum()),
                       "choice_nll": dict(zip(names, map(float, row))) if len(names) > 1 else {}}
                      for (d, _), a, j, row in zip(docs, scored, chosen, choice_nll)],
    }
    if own is not None:
        out["own_choice"] = {d: c.get(own.get(d, BASE), 0) / sum(c.values()) for d, c in choice.items()}
    return out


def _fig(nll: float, n: int) -> dict:
    """{ppl, nll (mean nats a token), n_tokens}; None figures where nothing was scored (every document was short)."""
    if n == 0:
        return {"ppl": None, "nll": None, "n_tokens": 0}
    return {"ppl": math.exp(nll / n), "nll": float(nll / n), "n_tokens": int(n)}


__all__ = ["BASE", "CHOOSE_TOKENS", "domain_stream", "split_documents", "stream_candidates"]
