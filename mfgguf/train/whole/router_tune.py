"""Router-only tuning of a finished MoE GGUF: gradient steps on the router rows alone, written back.

The closed-form router (ridge on the experts' recorded statistics) is the warm start. Everything
else stays frozen: the PyTorch reference of the file (reference.py: the RUN's f32 modules, the
file's experts, top-k and router rows) runs the language-modelling loss on windows of the
experts' own shards (an equal share each; the RUN's other domains, such as one held out to
measure forgetting, are never read), and Adam moves only `ffn_gate_inp`. FlexOlmo and BTX tune
the router after merging the same way, on about 1% of the experts' tokens.

Why a straight-through gate: both layouts llama.cpp runs renormalise the selected softmax weights,
so with top-1 the weight is exactly 1 and the router gets no gradient at all. Tuning divides by
the selected weights' sum held constant instead (Switch Transformer's gate): the forward pass is
unchanged, bit for bit, and each selected expert's logit is pushed up when scaling its output up
would lower the loss, down when it would raise it (the others move through the softmax).

The rows are kept only if they lower the perplexity llama.cpp computes on validation windows of
the same shards that tuning never saw (the last tenth of each shard); otherwise the file's rows are
written back unchanged, so tuning never makes that sample worse. `mfgguf.router_tuning` (JSON)
records the settings and both perplexities. The held-out split is never opened.

Example:
    >>> r = tune_router(Path("model.gguf"), Path("RUN"), Path("tuned.gguf"))
    >>> r["ppl_before"], r["ppl_after"], r["kept"]
"""

from __future__ import annotations

import json
import math
import os
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from mfgguf.data.masks import counted_share, load_mask
from mfgguf.gguf.edit import copy_with_kv, read_f32, read_kv, set_f32, write_edited
from mfgguf.gguf.schema import TUNING_KEY
from mfgguf.errors import MfggufError
from mfgguf.run import ModuleMeta, RunDir, atomic_path, read_module

VALIDATION_FRACTION = 0.1  # the tail of each shard that tuning never trains on: the keep-or-drop sample


@dataclass(frozen=True)
class RouterTuning:
    tokens: int | None = None  # tuning windows' tokens in all; None: 1% of the experts' training tokens
    epochs: int = 4  # passes over those windows
    lr: float = 1e-3  # Adam's step on the router rows (their entries are O(0.1) after the ridge fit)
    batch_size: int = 8  # windows per step
    micro_batch: int = 2  # windows per forward/backward (gradients accumulate): bounds the peak (docs/assembly.md)
    ctx: int | None = None  # tuning window; None: the context the experts trained with
    val_tokens: int = 8192  # validation tokens scored by llama.cpp before and after, spread over the experts
    val_ctx: int | None = None  # llama.cpp's scoring window; None: 1,024 or the model's context
    seed: int = 0  # which tuning windows, in which order
    precision: str = "auto"  # bf16 autocast where native (the rows and Adam stay f32)


def tune_router(model: Path, run: Path, out: Path, *, tuning: RouterTuning = RouterTuning(), threads: int | None = None,
                force: bool = False, progress: bool = True) -> dict:
    """Tune only the router of MODEL by gradient steps on its experts' training data; write OUT.

    MODEL is a MoE GGUF written by `mfgguf assemble` (or `calibrate`, `extend`) from RUN, whose
    modules are still there. The closed-form router is the warm start; the loss is the language
    model's on windows of the file's experts' shards (an equal share each, --tokens in all,
    default 1% of the experts' training tokens) with the file's top-k; nothing but the router rows
    moves. The tuned rows are kept only where llama.cpp's perplexity on validation windows that
    tuning never saw (each shard's last tenth) is lower; OUT then differs from MODEL in its router
    tensors and the `mfgguf.router_tuning` record only. The held-out split is never read.
    """
    from mfgguf.reference import gguf_provenance
    from mfgguf.runtime.llm import check_ctx, read_header
    from mfgguf.runtime.perplexity import WINDOW

    model, out, rd, t = Path(model), Path(out), RunDir(run), tuning
    _check_args(model, out, rd, t, force)
    prov = gguf_provenance(model)
    experts = prov["experts"]
    if len(experts) + prov["routed_seed"] < 2:
        raise MfggufError(f"{model} routes {len(experts) + prov['routed_seed']} FFN; router tuning needs a MoE GGUF with 2+ experts")
    metas = _checked_metas(rd, model, experts)  # {0: trunk, i: expert i}
    ctx = int(t.ctx or metas[0].config["ctx_len"])
    budget = t.tokens if t.tokens is not None else sum(int(metas[i].tokens_seen or 0) for i in experts) // 100
    if budget < 1:
        raise MfggufError(f"--tokens {budget} is too small; pass a positive number of tuning tokens")
    header = read_header(model)
    val_ctx = check_ctx(header, t.val_ctx or min(WINDOW, header["context_length"]))
    sample = sample_windows(rd, experts, budget, ctx, t.val_tokens, val_ctx, t.seed)
    windows, val = sample.windows, sample.val  # (W, ctx+1), (V,)

    tuned, before_rows, history, precision, tune_s = _tune_rows(rd, model, sample, t, ctx, progress)

    say = (lambda s: print(s, file=sys.stderr, flush=True)) if progress else (lambda s: None)
    before, after = _score(model, out, tuned, sample, val_ctx, threads)
    kept = after["nll"] < before["nll"]
    say(f"tune-router: validation ppl {before['ppl']:.4f} -> {after['ppl']:.4f}: "
        + ("tuned rows kept" if kept else "tuned rows dropped, the file's rows written back"))
    record = {**asdict(t), "tokens": int(windows.size - len(windows)), "ctx": ctx, "val_ctx": val_ctx,
              "val_tokens": int(len(val)), "steps": len(history), "precision": precision, "tune_s": tune_s,
              "loss_first": history[0], "loss_last": history[-1], "ppl_before": before["ppl"],
              "ppl_tuned": after["ppl"], "kept": kept, "sample": [f"data/shard_{i:03d}.npy" for i in experts],
              "previous": read_kv(model).get(TUNING_KEY)}
    final = tuned if kept else before_rows
    out.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(out, suffix=f".{os.getpid()}") as tmp:
        write_edited(model, tmp, [(TUNING_KEY, "STRING", json.dumps(record, sort_keys=True))], final, "the tuned file")
        os.chmod(tmp, 0o644)
    return {"path": str(out), "model": str(model), "kept": kept, "ppl_before": before["ppl"],
            "ppl_tuned": after["ppl"], "ppl_after": after["ppl"] if kept else before["ppl"],
            "tokens": record["tokens"], "steps": len(history), "tune_s": tune_s, "val_tokens": record["val_tokens"],
            "loss_first": history[0], "loss_last": history[-1], "history": history}


def _check_args(model: Path, out: Path, rd: RunDir, t: RouterTuning, force: bool) -> None:
    if not rd.root.is_dir():
        raise MfggufError(f"RUN directory not found: {rd.root}; pass the RUN the model was assembled from")
    if not model.is_file():
        raise MfggufError(f"{model} not found; pass a MoE .gguf written by `mfgguf assemble`")
    if out.is_dir():
        raise MfggufError(f"{out} is a directory; give a file name such as {out / 'tuned.gguf'}")
    if out.exists() and not force:
        raise MfggufError(f"-o {out} is MODEL itself; pass --force to rewrite it in place" if out.resolve() == model.resolve()
                          else f"{out} already exists; pass --force to overwrite it")
    for name, v in (("--epochs", t.epochs), ("--batch-size", t.batch_size), ("--micro-batch", t.micro_batch),
                    ("--val-tokens", t.val_tokens)):
        if v < 1:
            raise MfggufError(f"{name} {v} is too small; pass a positive number")
    if not t.lr > 0:
        raise MfggufError(f"--lr {t.lr} must be positive")


def _tune_rows(rd: RunDir, model: Path, sample: TuningSample, t: RouterTuning, ctx: int, progress: bool):
    """Adam steps on the router rows alone, the rest of the reference model frozen; (tuned rows by tensor name,
    the file's rows, the loss per step, the precision, the seconds)."""
    import torch  # here, not at the top: the CLI imports this module for its defaults and must start without torch

    from mfgguf.data.masks import mask_targets
    from mfgguf.reference import reference_model
    from mfgguf.train.engine.loop import autocast, resolve_precision

    windows = sample.windows

    dev = torch.device("cpu")
    precision = resolve_precision(t.precision, dev)
    torch.manual_seed(t.seed)
    net, route = reference_model(rd.root, model)
    for p in net.parameters():
        p.requires_grad_(False)
    rows = [layer.router for layer in net.layers]  # (N, dim) each: the only parameters that move
    for r in rows:
        r.requires_grad_(True)
    for layer in net.layers:
        layer.straight_through_gates = True
    opt = torch.optim.Adam(rows, lr=t.lr)
    rng = np.random.default_rng(t.seed)
    steps = t.epochs * max(1, math.ceil(len(windows) / t.batch_size))
    history, t0 = [], time.perf_counter()
    bar = _bar(progress, steps * t.batch_size * ctx)
    try:
        for epoch in range(t.epochs):
            order = rng.permutation(len(windows))
            for s in range(0, len(order), t.batch_size):
                picked = order[s:s + t.batch_size]
                xy = torch.from_numpy(windows[picked])  # (b, ctx + 1)
                y = xy[:, 1:] if sample.counted is None else mask_targets(xy[:, 1:], sample.counted[picked])  # (b, ctx)
                opt.zero_grad(set_to_none=True)
                total = 0.0
                for part, yp in zip(xy.split(t.micro_batch), y.split(t.micro_batch)):  # (m, ctx + 1), (m, ctx)
                    with autocast(precision, dev):
                        loss = net(part[:, :-1], yp, route=route) * counted_share(yp, y)
                    loss.backward()
                    total += loss.item()
                opt.step()
                history.append(total)
                if bar:
                    done = len(history) * t.batch_size * ctx
                    bar.update(done, history[-1], time.perf_counter() - t0, done)
    finally:
        if bar:
            bar.close()
    tune_s = time.perf_counter() - t0
    names = [f"blk.{l}.ffn_gate_inp.weight" for l in range(len(rows))]
    before_rows = read_f32(model, names)
    tuned = {n: r.detach().float().numpy().reshape(before_rows[n].shape) for n, r in zip(names, rows)}
    return tuned, before_rows, history, precision, tune_s  # the reference's f32 weights go: llama.cpp scores next


def _score(model: Path, out: Path, tuned: dict[str, np.ndarray], sample: TuningSample, val_ctx: int,
           threads: int | None) -> tuple[dict, dict]:
    """llama.cpp's perplexity on the validation windows with the file's rows, then with the tuned ones (on the
    tokens the experts' loss counted: a conversation's answers)."""
    from mfgguf.runtime.perplexity import perplexity

    with tempfile.TemporaryDirectory(prefix=f".{out.name}.tune.", dir=out.parent if out.parent.is_dir() else None) as td:
        scratch = Path(td) / "candidate.gguf"
        copy_with_kv(model, scratch, [])
        before = perplexity(scratch, sample.val, ctx=val_ctx, threads=threads, mask=sample.val_mask)
        set_f32(scratch, tuned)
        after = perplexity(scratch, sample.val, ctx=val_ctx, threads=threads, mask=sample.val_mask)
    return before, after


@dataclass(frozen=True)
class TuningSample:
    """What router tuning reads of the experts' shards; the masks are None where no shard has one (raw text)."""
    windows: np.ndarray  # (W, ctx + 1) int64: tuning windows
    counted: np.ndarray | None  # (W, ctx) uint8: whether each window's target counts in the loss (data/masks.py)
    val: np.ndarray  # (V,) int64: validation tokens, windows of val_ctx end to end
    val_mask: np.ndarray | None  # (V,) uint8: whether each validation token is scored


def sample_windows(rd: RunDir, experts: list[int], tokens: int, ctx: int, val_tokens: int, val_ctx: int,
                   seed: int) -> TuningSample:
    """Tuning windows and validation tokens from the experts' shards, with their loss masks where a shard has one
    (a conversation's context turns are read, never a target, as the experts were trained).

    Each shard gives an equal share (the first ones one window more where it does not divide): tuning
    windows from its first nine tenths, a shuffled pass over their grid as training draws one
    (driver.window_starts, on the expert's stream), so they repeat only where a share exceeds a pass;
    validation windows of val_ctx evenly spaced over its last tenth. At least one tuning window each.
    """
    from mfgguf.train.engine.driver import window_starts  # here: the CLI imports this module without torch

    n_win = max(len(experts), math.ceil(tokens / ctx))
    per_val = max(1, math.ceil(val_tokens / len(experts) / val_ctx))
    wins, vals, win_masks, val_masks, masked = [], [], [], [], False
    for k, i in enumerate(experts):
        per = n_win // len(experts) + (k < n_win % len(experts))
        path = rd.shard(i)
        if not path.is_file():
            raise MfggufError(f"{path} is missing: router tuning trains on the experts' shards; re-create the run with `mfgguf prepare`")
        s = np.load(path, mmap_mode="r", allow_pickle=False)  # (T,)
        cut = int(len(s) * (1 - VALIDATION_FRACTION))
        if cut < ctx + 1 or len(s) - cut < val_ctx:
            raise MfggufError(f"{path} has {len(s)} tokens, too few for --ctx {ctx} and a validation window of {val_ctx}; "
                              "pass a smaller --ctx or --val-ctx")
        m = load_mask(path, len(s))
        masked |= m is not None
        m = np.ones(len(s), np.uint8) if m is None else m  # (T,)
        for a in window_starts(cut, ctx, seed, i, np.arange(per)):
            wins.append(np.asarray(s[a:a + ctx + 1], np.int64))
            win_masks.append(np.asarray(m[a + 1:a + ctx + 1]))
        for a in np.linspace(cut, len(s) - val_ctx, min(per_val, (len(s) - cut) // val_ctx)).astype(np.int64):
            vals.append(np.asarray(s[a:a + val_ctx], np.int64))
            val_masks.append(np.asarray(m[a:a + val_ctx]))
    return TuningSample(np.stack(wins), np.stack(win_masks) if masked else None, np.concatenate(vals),
                        np.concatenate(val_masks) if masked else None)


def _checked_metas(rd: RunDir, model: Path, experts: list[int]) -> dict[int, ModuleMeta]:
    """The metadata of the trunk (0) and `experts`, which must be the very modules the file was built from
    (its recorded sha256s)."""
    shas = read_kv(model).get("mfgguf.module_sha256") or []
    if len(shas) != len(experts) + 1:
        raise MfggufError(f"{model} does not record the modules it was built from (mfgguf.module_sha256); "
                          "re-assemble it with `mfgguf assemble`")
    metas = {}
    for i, sha in zip([0, *experts], shas):
        path = rd.module_meta(i)
        if not path.is_file():
            raise MfggufError(f"{path} is missing; pass the RUN the model was assembled from")
        metas[i] = read_module(rd, i)
        if metas[i].sha256 != sha:
            what = "the trunk" if i == 0 else f"expert {i}"
            raise MfggufError(f"{what} in {rd.root} is not the one {model} was assembled from; pass the right --run")
    return metas


def _bar(progress: bool, total: int):
    if not progress:
        return None
    from mfgguf.train.engine.driver import Progress

    return Progress("tune-router", total, 0)
