"""`mfgguf relabel`: one EM round over the partition, the experts choosing their own documents.

SmallTalk LM trains its experts on clusters and then reassigns every document to the expert whose
model predicts it best, by the loss on the document's first tokens (the same prefix a router sees
first). Here the trained experts of RUN score every document of their shards (trunk + that one
expert, forward only, one expert in memory at a time), data/relabel.py assigns each to the best
expert under a capacity, and a new RUN is written with the new shards and RUN's trunk, tokenizer,
training mix and held-out split (hard links where possible): train its experts again there, then
`router-stats` and `assemble` as usual. Shards of experts not selected are carried over unchanged.

Example:
    >>> relabel(Path("RUN"), Path("RUN-em"), experts=[1, 2, 4, 5])["relabel"]["moved_docs"]
"""

from __future__ import annotations

import shutil
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from mfgguf.config import ModelConfig
from mfgguf.data.masks import link_mask, load_mask, span_masks, write_mask
from mfgguf.data.prepare import write_tokens
from mfgguf.data.relabel import assign_balanced, documents
from mfgguf.errors import MfggufError
from mfgguf.flops import expert_step_flops
from mfgguf.options import parse_experts
from mfgguf.run import (RunDir, link_or_copy, module_name, read_json, swap_dir_into_place, trained_copies, trained_expert_meta,
                        write_json)
from mfgguf.train.engine.driver import Progress
from mfgguf.train.experts.expert import build_expert_model, load_trunk_meta
from mfgguf.train.engine.loop import EVAL_ROWS, autocast, head_loss, load_tokens, resolve_device, scoring_positions
from mfgguf.train.rounds.restat import precision_of
from mfgguf.train.engine.weights import read_safetensors


@dataclass
class Relabelling:
    """How documents are scored and reassigned."""

    prefix: int = 256  # tokens of each document scored (SmallTalk LM routes by a 256-token prefix); shorter docs whole
    cap: float = 1.5  # a new shard holds at most cap x the mean shard's tokens: a generalist cannot take everything
    tokens: int | None = None  # documents drawn at random from each shard up to this many tokens are scored and
    #                            form the new shards (the rest is left out); None = all. Scoring costs a forward per
    #                            prefix token per expert, more than training when experts see a few % of their shard
    keep_labels: bool = False  # the control of a study: the same draw, no scoring, every document in its old shard
    seed: int = 0  # the new shards' document order (experts sample random windows; tune-router validates on the tail)


def relabel(run: Path, out: Path, *, experts: str | list[int] | None = None, prefix: int = 256, cap: float = 1.5,
            tokens: int | None = None, keep_labels: bool = False, force: bool = False, device: str = "cpu",
            progress: bool = True) -> dict:
    """Reassign the training documents of RUN's experts to the expert that predicts each best (one EM round,
    as SmallTalk LM does) and write a new RUN at OUT with those shards, ready for `train-expert`.

    Every document of the selected experts' shards is scored by each of them (trunk + that expert, forward only)
    on its first PREFIX tokens; it goes to the lowest mean loss, under a capacity of CAP x the mean shard's
    tokens placed surest-first (so no expert takes every shard). OUT gets RUN's trunk, tokenizer, base, training
    mix and held-out split (hard-linked) and the new shards; no experts: train them there, then `router-stats`
    and `assemble`. Its run.json records the moves (tokens from each old shard to each new one) and the mean
    prefix loss under the old and the new assignment, the tokens scored and their forward FLOPs. Returns OUT's
    run.json.

    Example:
        >>> relabel(Path("RUN"), Path("RUN-em"), experts="1,2,4,5")["relabel"]["moved_docs"]
    """
    t0 = time.perf_counter()
    rd, dst = RunDir(run), RunDir(out)
    cfgr = Relabelling(prefix=int(prefix), cap=float(cap), tokens=None if tokens is None else int(tokens),
                       keep_labels=bool(keep_labels))
    info = rd.info()
    ids = parse_experts(experts, int(info["n_experts"])) if not isinstance(experts, list) else experts
    ids = list(range(1, int(info["n_experts"]) + 1)) if ids is None else [rd.check_expert_index(int(i)) for i in ids]
    _check(rd, dst, ids, cfgr, force)
    trunk = load_trunk_meta(rd)
    metas = {} if cfgr.keep_labels else {i: _expert_meta(rd, trunk, i) for i in ids}  # the control scores nothing
    cfg = ModelConfig.from_dict(trunk["config"])
    eos = int(info["eos_id"])

    shards = {i: load_tokens(rd.shard(i), f"shard {i}") for i in ids}
    spans = [(i, s, e) for i in ids for s, e in _drawn(documents(shards[i], eos), cfgr, i)]  # (old shard, start, end)
    weights = np.array([e - s + 1 for _, s, e in spans])  # (D,) tokens with its EOS
    origin = np.array([ids.index(i) for i, _, _ in spans])  # (D,) column of its old shard
    # token forwards of the scoring: each document's first prefix+1 tokens, once per expert (the control: none)
    scored = 0 if cfgr.keep_labels else len(ids) * sum(min(e - s, cfgr.prefix + 1) for _, s, e in spans)
    if cfgr.keep_labels:  # the control: the same draw, every document where it was
        new, losses, unscored = origin.copy(), None, None
    else:
        prec = precision_of(next(iter(metas.values())))
        losses = _score(rd, cfg, ids, shards, spans, cfgr.prefix, resolve_device(device), prec,
                        _bar(progress, scored))  # (D, E)
        unscored = np.isnan(losses).any(axis=1)  # one-token documents: they stay where they were
        losses[unscored] = np.inf
        losses[unscored, origin[unscored]] = 0.0
        new = assign_balanced(losses, weights, cfgr.cap)  # (D,) column of its new shard

    record = _record(rd, ids, spans, weights, origin, new, losses, unscored, cfgr)
    # what the round costs beside the experts' training: a forward of every scored token through trunk + expert
    record.update(scored_tokens=scored, forward_flops=scored * expert_step_flops(cfg).forward,
                  seconds=round(time.perf_counter() - t0, 2))
    return _write_run(rd, dst, ids, shards, spans, new, record, info, cfgr)


def _score(rd: RunDir, cfg: ModelConfig, ids: list[int], shards: dict, spans: list, prefix: int, dev, prec: str,
           bar) -> np.ndarray:
    """(D, E) mean prefix loss of each document under each expert, one expert in memory at a time."""
    losses = np.full((len(spans), len(ids)), np.nan)
    try:  # the bar is already running: stop it whatever fails
        model = build_expert_model(rd, cfg, 0, dev, bf16_trunk=prec == "bf16")
        for col, i in enumerate(ids):
            model.load_expert({k: t for k, t in read_safetensors(rd.module_file(i)) if k.startswith("blk.")})
            losses[:, col] = prefix_losses(model, shards, spans, prefix, dev, prec, bar, module_name(i))
    finally:
        if bar is not None:
            bar.close()
    return losses


def _drawn(docs: list[tuple[int, int]], c: Relabelling, i: int) -> list[tuple[int, int]]:
    """All of a shard's documents, or (with c.tokens) a random draw of them holding at least c.tokens tokens."""
    if c.tokens is None:
        return docs
    order = np.random.default_rng([c.seed, 11, i]).permutation(len(docs))
    sizes = np.array([e - s + 1 for s, e in docs])[order]
    keep = order[: int(np.searchsorted(np.cumsum(sizes), c.tokens)) + 1]
    return [docs[k] for k in sorted(keep)]


@torch.no_grad()
def prefix_losses(model, shards: dict, spans: list, prefix: int, dev, prec: str, bar=None, label: str = "") -> np.ndarray:
    """(D,) mean next-token loss over each document's first `prefix` predictions (all of a shorter one's);
    nan for a one-token document. Documents at least prefix+1 long run in batches of whole windows."""
    model.eval()
    out = np.full(len(spans), np.nan)
    full = [d for d, (_, s, e) in enumerate(spans) if e - s >= prefix + 1]
    rows = max(1, EVAL_ROWS // prefix)
    for b in range(0, len(full), rows):
        batch = full[b : b + rows]
        w = np.stack([np.asarray(shards[i][s : s + prefix + 1], dtype=np.int64) for i, s, _ in (spans[d] for d in batch)])
        out[batch] = _row_losses(model, torch.from_numpy(w).to(dev), dev, prec)  # w: (b, prefix+1)
        _advance(bar, label, len(batch) * (prefix + 1))
    for d, (i, s, e) in enumerate(spans):
        if 2 <= e - s < prefix + 1:
            w = torch.from_numpy(np.asarray(shards[i][s:e], dtype=np.int64)[None]).to(dev)  # (1, e-s)
            out[d] = _row_losses(model, w, dev, prec)[0]
            _advance(bar, label, e - s)
    return out


def _row_losses(model, w: torch.Tensor, dev, prec: str) -> np.ndarray:
    """w (b, T+1) -> (b,) mean loss of each row's T predictions; the head as scoring chunks it."""
    b, T = w.shape[0], w.shape[1] - 1
    step = scoring_positions(model)
    with autocast(prec, dev):
        x = model.hidden(w[:, :-1], route="single").reshape(b * T, -1)  # (b*T, C)
        y = w[:, 1:].reshape(-1)  # (b*T,)
        nll = torch.cat([head_loss(model, x[s : s + step], y[s : s + step], "none") for s in range(0, b * T, step)])
    return nll.view(b, T).mean(dim=1).float().cpu().numpy()


# ---- checks, record, output ----------------------------------------------------------------------


def _check(rd: RunDir, dst: RunDir, ids: list[int], c: Relabelling, force: bool) -> None:
    if len(ids) < 2 or len(set(ids)) != len(ids):
        raise MfggufError(f"relabelling needs at least two distinct experts to choose between, got {ids}; pass --experts")
    if c.tokens is not None and c.tokens < 1:
        raise MfggufError(f"--tokens must be a positive number of tokens per shard, got {c.tokens}")
    if c.prefix < 1:
        raise MfggufError(f"--prefix must be at least 1 token, got {c.prefix}")
    if not c.cap >= 1.0:
        raise MfggufError(f"--cap must be at least 1 (a shard may hold cap x the mean shard's tokens), got {c.cap}")
    if dst.root.resolve() == rd.root.resolve():
        raise MfggufError(f"OUT is RUN itself ({rd.root}); relabelling writes a new RUN: choose another -o")
    if dst.root.exists() and not force:
        raise MfggufError(f"{dst.root} already exists; choose another -o or pass --force to replace it")


def _expert_meta(rd: RunDir, trunk: dict, i: int) -> dict:
    m = trained_expert_meta(rd, trunk["sha256"], i, "mfgguf relabel")
    if m.get("complement") or trained_copies(m):
        raise MfggufError(f"{module_name(i)} was trained with --complement or --shared; relabelling scores plain"
                          " experts (trunk + one FFN) only")
    return m


def _record(rd: RunDir, ids, spans, weights, origin, new, losses, unscored, c: Relabelling) -> dict:
    moves = {f"shard {i}": {f"shard {j}": int(weights[(origin == a) & (new == b)].sum()) for b, j in enumerate(ids)}
             for a, i in enumerate(ids)}
    out = {"from": str(rd.root), "experts": ids, **asdict(c), "docs": len(spans),
           "moved_docs": int((new != origin).sum()), "moved_tokens": int(weights[new != origin].sum()),
           "prefix_loss_before": None, "prefix_loss_after": None, "moves": moves}
    if losses is None:
        return out
    d = np.arange(len(new))
    w = np.where(unscored, 0, weights)  # one-token documents have no loss to average
    before = float(np.sum(np.where(unscored, 0, losses[d, origin]) * w) / max(w.sum(), 1))  # token-weighted means
    after = float(np.sum(np.where(unscored, 0, losses[d, new]) * w) / max(w.sum(), 1))
    return {**out, "prefix_loss_before": round(before, 5), "prefix_loss_after": round(after, 5)}


def _write_run(rd: RunDir, dst: RunDir, ids, shards, spans, new, record: dict, info: dict, c: Relabelling) -> dict:
    dst.root.parent.mkdir(parents=True, exist_ok=True)
    tmp = RunDir(Path(tempfile.mkdtemp(prefix=f".{dst.root.name}.", suffix=".tmp", dir=dst.root.parent)))
    try:
        tmp.modules.mkdir(parents=True)
        tmp.data.mkdir()
        rd.copy_vocab_to(tmp)  # tokenizer.json, or an imported base's base/ (run.json is rewritten below)
        for f in (rd.module_file(0), rd.module_meta(0)):  # the trunk the experts scored against, shared by link
            link_or_copy(f, tmp.modules / f.name)
        man = read_json(rd.manifest, "the run manifest")
        write_json(tmp.manifest, {**man, "modules": {"trunk": man["modules"]["trunk"]}})
        link_or_copy(rd.train_tokens, tmp.train_tokens)
        link_mask(rd.train_tokens, tmp.train_tokens)  # a chat RUN's loss masks go with their tokens
        for split in {rd.heldout_dir, rd.validation_dir}:  # the test and validation splits (one dir on older RUNs)
            (tmp.data / split.name).mkdir()
            for f in split.iterdir():
                link_or_copy(f, tmp.data / split.name / f.name)
        rows = {s["id"]: s for s in info["shards"]}
        out_shards = []
        rng = np.random.default_rng([c.seed, 7])
        masks = {i: load_mask(rd.shard(i)) for i in ids}
        dtype = np.dtype(info["token_dtype"])
        for k in range(1, int(info["n_experts"]) + 1):
            if k not in ids:
                link_or_copy(rd.shard(k), tmp.shard(k))
                link_mask(rd.shard(k), tmp.shard(k))
                out_shards.append(rows[k])
                continue
            col = ids.index(k)
            mine = rng.permutation(np.flatnonzero(new == col))
            docs = [shards[spans[d][0]][spans[d][1]: spans[d][2]] for d in mine]
            n = write_tokens(tmp.shard(k), docs, range(len(docs)), dtype, int(info["eos_id"]))
            write_mask(tmp.shard(k), span_masks(masks, [spans[d] for d in mine]), docs, range(len(docs)))
            from_ = record["moves"]
            got = {i: from_[f"shard {i}"][f"shard {k}"] for i in ids}
            out_shards.append({"id": k, "docs": len(docs), "tokens": n, "domains": _domains(rows, got),
                               "relabelled_from": {f"shard {i}": t for i, t in got.items() if t}})
        new_info = {**info, "shards": out_shards, "relabel": record}
        write_json(tmp.run_json, new_info)
        swap_dir_into_place(tmp.root, dst.root)
    except BaseException:
        shutil.rmtree(tmp.root, ignore_errors=True)
        raise
    return new_info


def _domains(rows: dict, got: dict[int, int]) -> dict[str, int]:
    """A new shard's tokens per domain: each old shard's share spread by that shard's own composition
    (exact when old shards hold one domain each, as `--partition label` makes them)."""
    out: dict[str, float] = {}
    for i, t in got.items():
        comp = rows[i]["domains"]
        total = sum(comp.values()) or 1
        for d, v in comp.items():
            out[d] = out.get(d, 0.0) + t * v / total
    return {d: int(round(v)) for d, v in sorted(out.items()) if round(v)}


def _advance(bar, label: str, n: int) -> None:
    if bar is not None:
        bar.advance(label, n)


class _Scored:
    """Tokens scored so far, over every expert, shown by the training bar (no loss column)."""

    def __init__(self, total: int):
        self.t0, self.done = time.perf_counter(), 0
        self.bar = Progress("relabel", total, 0, stderr=True)

    def advance(self, label: str, n: int) -> None:
        self.done += n
        self.bar.update(self.done, None, time.perf_counter() - self.t0, self.done, label=f"relabel {label}")

    def close(self) -> None:
        self.bar.close()


def _bar(progress: bool, total: int):
    return _Scored(total) if progress else None
