"""Train the trunk (module 0) from scratch on the mixed corpus: route "anchor", every parameter trains.

With `seed_expert` the trunk also trains one expert-width FFN beside the anchor (route "single"):
the seed, written to the trunk file, that every expert starts from (BTX: branch from a trained
dense model instead of growing FFNs from random weights next to a frozen trunk).

The dense baselines of `mfgguf eval` are the same call on a copy of the RUN with a wider anchor:
`train-trunk COPY --preset small --anchor-ff 1024 --tokens ...` (mfgguf/eval/baselines/scratch.py).
Every `eval_every` steps the held-out loss is recorded (`validation_history`): the training curve.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

import torch

from mfgguf.base.runbase import imported
from mfgguf.config import DEFAULT_PRESET, get_preset
from mfgguf.data.masks import load_mask
from mfgguf.flops import trunk_step_flops
from mfgguf.machine import mem_available
from mfgguf.errors import MfggufError
from mfgguf.model import seed_name_map, trunk_model, trunk_name_map
from mfgguf.options import TrainOptions
from mfgguf.plots import loss_curve
from mfgguf.head_loss import LOGITS_CHUNK
from mfgguf.run import RunDir, RunInfo, module_name, write_module, write_module_streamed
from mfgguf.train.whole import branch as br
from mfgguf.train.engine import checkpoint as ckpt_io
from mfgguf.train.engine.driver import cooldown_start, schedule_steps
from mfgguf.train.engine.loop import (check_token_range, validation_losses, limit_heap_retention, load_tokens, resolve_device,
                   resolve_precision, result_meta, run_loop)
from mfgguf.train.engine.records import Checkpoints, Drive, StepSetup

ACTIVATION_BUDGET = 1 << 30  # bytes of saved activations above which blocks are recomputed (auto)
MICRO_BATCH_PER_TRUNK = 1.5  # a large base's micro-batch may hold this many times its bf16 trunk in activations
MICRO_BATCH_CAP = 2 << 30  # bytes: the most activations micro_batch_budget allows a large base
# bytes: what one expert step may hold in all, as estimated by step_bytes (the bf16 trunk, the expert's f32 weights,
# gradients and AdamW moments, one micro-batch's activations): a large base takes smaller micro-batches to stay in it,
# so a laptop keeps room for the rest (Llama-3.2-1B: micro-batches of 1; docs/studies/speed.md)
EXPERT_STEP_BUDGET = 11 << 29
ONE_SEQUENCE_BUDGET = 11 << 27  # bytes: one sequence's activations + the trunk in bf16, for micro-batches of 1
#                                 (SmolLM2 at ctx 512 fits and trains so; `1b` does not: recompute; docs/memory.md)
STREAMED_ACCUM = 4  # streamed runs: sequences per step = batch_size x this unless --accum says otherwise
#                     (the step's I/O is fixed; see docs/results/bench-trunk-stream.jsonl)


def activation_bytes(cfg, sequences: int) -> int:
    """A rough (high, at SmolLM2's shape: docs/memory.md) estimate of one forward's saved activations."""
    per_tok_layer = 4 * (12 * cfg.dim + 3 * (cfg.anchor_ff + cfg.expert_ff))  # bytes, bf16/f32 mix
    head = 4 * cfg.dim  # the gradient the head's loss keeps per position; its logits live a chunk at a time
    return sequences * cfg.ctx_len * (cfg.n_layers * per_tok_layer + head) + 3 * 4 * LOGITS_CHUNK  # (head_loss.py)


def wants_recompute(cfg, batch_size: int) -> bool:
    """Recompute blocks when one step's activations exceed the budget."""
    return activation_bytes(cfg, batch_size) > ACTIVATION_BUDGET


def micro_batch_budget(cfg) -> int:
    """Bytes of activations a micro-batch may hold: ACTIVATION_BUDGET, or MICRO_BATCH_PER_TRUNK times the
    trunk's bf16 weights when that is more, up to MICRO_BATCH_CAP. Who brings a large base has the memory to
    hold it, and at Qwen2.5-0.5B's shape micro-batches of 2 beat recompute well inside the memory goal set
    for that shape (docs/studies/speed.md, "At a published shape"); SmolLM2 and the `1b` preset keep
    ACTIVATION_BUDGET."""
    return int(min(max(ACTIVATION_BUDGET, MICRO_BATCH_PER_TRUNK * 2 * cfg.trunk_params()), MICRO_BATCH_CAP))


def step_bytes(cfg, sequences: int) -> int:
    """Estimated bytes an expert step holds with micro-batches of `sequences`: the frozen trunk in bf16, the expert's
    weights, gradients and two AdamW moments in f32, and the micro-batch's activations (not the process itself)."""
    return 2 * cfg.trunk_params() + 16 * cfg.expert_params() + activation_bytes(cfg, sequences)


def plan_activations(cfg, batch_size: int) -> tuple[bool, int]:
    """(recompute, sequences per micro-batch) of an expert step under ACTIVATION_BUDGET.

    The whole batch when it fits; else the largest micro-batch of at least 2 sequences that fits,
    its gradients accumulated over the batch, without recompute; else single sequences where one
    sequence's activations and the trunk's bf16 weights fit ONE_SEQUENCE_BUDGET; else recompute over
    the whole batch. A micro-batch must also keep the whole step within EXPERT_STEP_BUDGET (step_bytes), which
    only a large base reaches; such a base (micro_batch_budget above ACTIVATION_BUDGET) takes single sequences
    where they fit it. That order is the measured one at SmolLM2's shape (scripts/bench/bench_train_real.py;
    the figures are in docs/memory.md): micro-batches beat recompute and the whole batch in speed at
    a fraction of the whole batch's memory. The `1b` preset (its trunk twice SmolLM2's) keeps recompute
    and its memory goal. A base whose trunk is large lets micro-batches take more (micro_batch_budget).
    """
    if not wants_recompute(cfg, batch_size):
        return False, batch_size
    budget = micro_batch_budget(cfg)
    fits = [d for d in range(2, batch_size) if batch_size % d == 0 and activation_bytes(cfg, d) <= budget
            and step_bytes(cfg, d) <= EXPERT_STEP_BUDGET]
    if fits:
        return False, max(fits)
    if activation_bytes(cfg, 1) + 2 * cfg.trunk_params() <= ONE_SEQUENCE_BUDGET:
        return False, 1
    if budget > ACTIVATION_BUDGET and step_bytes(cfg, 1) <= EXPERT_STEP_BUDGET:  # a large base, one sequence at a time
        return False, 1
    return True, batch_size


def in_memory_bytes(cfg, batch_size: int) -> int:
    """Estimated peak RSS of in-memory trunk training: f32 weights, gradients, two AdamW moments,
    the recomputed activations of one step, and the process itself."""
    from mfgguf.train.engine.streamed import BASELINE, block_bytes

    params = cfg.trunk_params()  # the seed FFN included (trunk_ff)
    acts = min(ACTIVATION_BUDGET, batch_size * cfg.ctx_len * cfg.n_layers * cfg.dim * 4) + block_bytes(cfg, batch_size * cfg.ctx_len)
    return BASELINE + 16 * params + acts


def parse_size(text: str) -> int:
    """Bytes of "1.5G", "800M", "2GiB" or "1500000000"; a one-line error otherwise.

    Example:
        >>> parse_size("1.5G")
        1610612736
    """
    t = str(text).strip().upper().removesuffix("IB").removesuffix("B")
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}.get(t[-1:], 1)
    try:
        n = float(t[:-1] if mult > 1 else t) * mult
    except ValueError:
        n = -1
    if not n > 0:
        raise MfggufError(f"--memory-budget {text!r} is not a size; write it like 1.5G or 800M")
    return int(n)


def train_trunk(run: Path, *, preset: str = DEFAULT_PRESET, options: TrainOptions = TrainOptions(), device: str = "cpu",
                progress: bool = True, precision: str = "auto", restart: bool = False,
                recompute: bool | None = None, memory_budget: str | None = None, stream: bool | None = None,
                accum: int | None = None) -> dict:
    """Train the trunk (embeddings, attention, norms, output head and the always-on anchor FFN) on the
    mixed training tokens of RUN; write modules/trunk.safetensors and its metadata. With
    `seed_expert=True` it also trains the seed FFN that experts start from (the trunk alone is then
    a dense model of FFN width anchor_ff + expert_ff).

    Memory: with `memory_budget` (like "1.5G") the trunk trains layer-streamed when the in-memory
    estimate exceeds it -- weights, gradients and AdamW moments in files under
    RUN/checkpoints/trunk/stream, one block in RAM at a time (mfgguf/train/engine/streamed.py); without
    it, when the estimate exceeds the RAM available; `stream` True/False forces the choice. A streamed step takes batch_size x `accum`
    sequences (default 4 when streamed, 1 in memory), cut into micro-batches that fit the budget.

    Resumes from RUN/checkpoints/trunk if a compatible checkpoint is there (--restart deletes it).
    Precision auto uses bf16 autocast where the CPU/GPU has native bf16, else fp32. `options`
    change the preset's TrainConfig fields (tokens, lr, batch_size, seed, ...) and ModelConfig
    fields (anchor_ff, seed_expert, dim, ...). Returns the module metadata (held-out loss per
    domain included).

    Example:
        >>> train_trunk(Path("RUN"), preset="tiny", options=TrainOptions(tokens=40_000))["validation_loss_mean"]
    """
    t_start = time.perf_counter()
    options.check("trunk", "train-trunk")
    rd = RunDir(run)
    info = rd.run_info()
    if imported(rd.root) is not None and rd.module_file(0).is_file() and not restart:
        raise MfggufError(f"{rd.root}'s trunk is the base model imported by `mfgguf import-base`; training a trunk here"
                          " would replace it. Train experts against it (`mfgguf train-expert`), or pass --restart to"
                          " replace it with a trunk trained from scratch")
    p = get_preset(preset)
    cfg = replace(p.model, vocab_size=int(info.vocab_size), n_experts=info.n_experts, **options.model_changes())
    cfg.validate()
    tc = options.train_config(p.trunk)
    dev = resolve_device(device)
    prec = resolve_precision(precision, dev)
    data = load_tokens(rd.train_tokens, "the trunk's training tokens")
    check_token_range(data, cfg.vocab_size, str(rd.train_tokens))
    ckpt_dir = rd.checkpoint_dir(0)
    if restart:
        ckpt_io.remove(ckpt_dir)
    if accum is not None and accum < 1:
        raise MfggufError(f"--accum {accum} must be at least 1")
    budget = parse_size(memory_budget) if memory_budget is not None else None
    limit = budget if budget is not None else mem_available(fallback=1 << 50)  # unknown: train in memory
    if _streams(cfg, tc, ckpt_dir, accum, budget, limit, stream, progress):
        return _train_streamed(rd, info, preset, cfg, tc, data, dev, prec, ckpt_dir, int(0.8 * limit) if budget is None else budget,
                               STREAMED_ACCUM if accum is None else accum, progress, t_start)
    tc = replace(tc, batch_size=tc.batch_size * (accum or 1))

    rec = wants_recompute(cfg, tc.batch_size) if recompute is None else recompute
    if rec:  # the memory-bound regime: keep freed buffers out of RSS
        limit_heap_retention()
    torch.manual_seed(tc.seed)
    model, route = trunk_model(cfg)
    model.reset_parameters(torch.Generator().manual_seed(tc.seed))  # init depends on the seed only
    model.to(dev)
    named = {n: p for n, p in model.named_parameters() if p.requires_grad}  # not the (unused) router row
    ckpt_meta = {"module": "trunk", "kind": "trunk", "preset": preset, "model": cfg.to_dict(), "train": asdict(tc)}
    curve = lambda: validation_losses(rd.validation_dir, model, tc.curve_tokens, route, dev, prec)  # noqa: E731
    setup = StepSetup(dev, prec, route, recompute=rec)
    ckpt = Checkpoints(ckpt_dir, ckpt_meta, branch_path=_branch_path(tc, ckpt_dir))
    drive = Drive(stream=0, label="trunk", progress=progress, validation=curve, mask=load_mask(rd.train_tokens, len(data)))
    res = run_loop(model, named, data, tc, setup=setup, ckpt=ckpt, drive=drive)

    validation = validation_losses(rd.validation_dir, model, tc.eval_tokens, route, dev, prec)
    if not validation:
        raise MfggufError(f"no held-out tokens in {rd.validation_dir}; re-create the run with `mfgguf prepare`")
    meta = {**result_meta(res, kind="trunk", preset=preset, cfg=cfg, tc=tc, info=info, setup=setup,
                          validation=validation, t_start=t_start),
            **_flops(cfg, res.tokens_seen), **schedule_meta(tc, cfg.ctx_len)}
    meta = write_module(rd, 0, model.trunk_tensors(), meta)
    _publish_branch(rd, tc, ckpt_dir, meta)
    loss_curve(rd.plots / f"loss_{module_name(0)}.png", res.history, validation=validation, curve=res.validation_history,
               title=f"trunk ({preset}, {cfg.n_layers}x{cfg.dim}, {res.tokens_seen:,} tokens)")
    ckpt_io.remove(ckpt_dir)
    return meta


def _streams(cfg, tc, ckpt_dir: Path, accum: int | None, budget: int | None, limit: int, stream: bool | None,
             progress: bool) -> bool:
    """Whether the trunk trains layer-streamed: forced by `stream`, else when a streamed checkpoint is there or the
    in-memory estimate exceeds `limit`; a checkpoint of the other kind is refused."""
    resumable = (ckpt_dir / "stream" / "state.json").is_file()
    streamed = resumable or in_memory_bytes(cfg, tc.batch_size * (accum or 1)) > limit if stream is None else stream
    if resumable and not streamed:
        raise MfggufError(f"{ckpt_dir} holds a layer-streamed checkpoint; continue it with --stream, or pass --restart"
                          " to start over in memory")
    if streamed:
        if (ckpt_dir / "state.safetensors").is_file():
            raise MfggufError(f"{ckpt_dir} holds an in-memory checkpoint but this run would stream; pass --restart"
                              " to start over streamed, or train without --memory-budget to continue it")
        if budget is None and stream is None and progress:
            print(f"trunk: about {in_memory_bytes(cfg, tc.batch_size) / 2**30:.1f} GiB in memory, more than the"
                  f" {limit / 2**30:.1f} GiB available: training layer-streamed", file=sys.stderr)
    return streamed


def _train_streamed(rd: RunDir, info: RunInfo, preset: str, cfg, tc, data, dev, prec: str, ckpt_dir: Path, budget: int,
                    accum: int, progress: bool, t_start: float) -> dict:
    """train_trunk's second half for a layer-streamed run (streamed.py): same meta, same module file."""
    from mfgguf.train.engine.offload import ParamStore, trunk_units
    from mfgguf.train.engine.streamed import StreamedTrunk, plan_micro, streamed_bytes
    from mfgguf.train.engine.streamed_loop import streamed_validation_losses, streamed_loop

    micro_of = tc.batch_size  # the user's batch: one micro-batch when it fits
    tc = replace(tc, batch_size=tc.batch_size * accum)
    units = trunk_units(cfg)
    micro, spill = plan_micro(cfg, units, tc.batch_size, budget)
    micro = min(micro_of, micro)  # both divide the accumulated batch, so their minimum does too
    limit_heap_retention()  # freed activations and buffers leave RSS at once
    store = ParamStore(ckpt_dir / "stream", units)
    route = "single" if cfg.seed_expert else "anchor"
    trunk = StreamedTrunk(cfg, route, store, dev, prec, micro, spill)
    group = micro * cfg.ctx_len  # tokens per forward pass when scoring held-out text
    ckpt_meta = {"module": "trunk", "kind": "trunk", "preset": preset, "model": cfg.to_dict(), "train": asdict(tc)}
    ckpt_meta = json.loads(json.dumps(ckpt_meta))  # as state.json will hold it (tuples -> lists)
    try:
        curve = lambda: streamed_validation_losses(trunk, rd.validation_dir, tc.curve_tokens, group)  # noqa: E731
        drive = Drive(stream=0, label="trunk (streamed)", progress=progress, validation=curve,
                      mask=load_mask(rd.train_tokens, len(data)))
        res = streamed_loop(trunk, data, tc, drive, ckpt_meta=ckpt_meta, branch_path=_branch_path(tc, ckpt_dir))
        validation = streamed_validation_losses(trunk, rd.validation_dir, tc.eval_tokens, group)
        if not validation:
            raise MfggufError(f"no held-out tokens in {rd.validation_dir}; re-create the run with `mfgguf prepare`")
        streamed = {"memory_budget": budget, "accum": accum, "micro_batch": micro, "spill_activations": spill,
                    "estimated_peak_bytes": streamed_bytes(cfg, units, tc.batch_size, micro, spill),
                    "disk_bytes": store.disk_bytes(), "read_bytes_per_step": res.io_per_step[0],
                    "written_bytes_per_step": res.io_per_step[1]}
        setup = StepSetup(dev, prec, route, recompute=True)  # a streamed backward recomputes inside each block
        meta = {**result_meta(res, kind="trunk", preset=preset, cfg=cfg, tc=tc, info=info, setup=setup,
                              validation=validation, t_start=t_start),
                **_flops(cfg, res.tokens_seen), **schedule_meta(tc, cfg.ctx_len), "streamed": streamed}
        names = trunk_name_map(cfg.n_layers, cfg.family) | (seed_name_map(cfg.n_layers) if cfg.seed_expert else {})
        where = {names[s.name]: (u, s) for u in units for s in u.slots}
        meta = write_module_streamed(rd, 0, {g: s.shape for g, (u, s) in where.items()},
                                     lambda g: store.read(where[g][0].name, trunk.set, "P", where[g][1]).reshape(where[g][1].shape),
                                     meta)
        _publish_branch(rd, tc, ckpt_dir, meta)
    finally:
        store.close()
    loss_curve(rd.plots / f"loss_{module_name(0)}.png", res.history, validation=validation, curve=res.validation_history,
               title=f"trunk ({preset}, streamed, {cfg.n_layers}x{cfg.dim}, {res.tokens_seen:,} tokens)")
    ckpt_io.remove(ckpt_dir)
    return meta


# ---- wsd: the branch point beside the cooled-down trunk (branch.py) ---------------------------------


def _flops(cfg, tokens_seen: int) -> dict:
    """The record's FLOPs of training (mfgguf/flops.py conventions)."""
    per_token = trunk_step_flops(cfg).total
    return {"flops_per_token": per_token, "train_flops": per_token * tokens_seen}


def _branch_path(tc, ckpt_dir: Path) -> Path | None:
    return ckpt_dir / br.BRANCH_FILE if tc.schedule == "wsd" else None


def schedule_meta(tc, ctx_len: int) -> dict:
    """The module JSON's record of a wsd schedule: the branch point and the cooldown's tokens (their FLOPs
    count in `mfgguf eval` like every other step's). Empty for cosine."""
    steps = schedule_steps(tc, ctx_len)
    start = cooldown_start(steps, tc)
    if start is None:
        return {}
    per_step = tc.batch_size * ctx_len
    return {"branch": {"step": start, "tokens": start * per_step, "lr": tc.lr},
            "cooldown_tokens": (steps - start) * per_step}


def _publish_branch(rd: RunDir, tc, ckpt_dir: Path, meta: dict) -> None:
    """After the trunk is written: its branch point beside it (wsd), or no stale one of an earlier trunk."""
    if tc.schedule == "wsd":
        br.publish(rd, ckpt_dir, meta)
    else:
        br.clear(rd)
