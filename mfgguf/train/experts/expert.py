"""Train expert i alone against the frozen trunk, on its own shard; record its router statistics.

The training forward is route "single": trunk + anchor + this expert, exactly what the assembled
model computes for a token routed to expert i (top-1 weight is 1). The expert starts with a zero
down-projection, so at step 0 the model is exactly the trunk and the expert can only add to it.

Memory: only the expert's parameters (and, with --shared, its private f32 copies of the chosen
trunk tensors: shared.py) have gradients and optimizer state. Under bf16 autocast the
frozen trunk's Linear weights are held in bf16 (autocast would cast them anyway, so the function is
the same); the trunk file is read one tensor at a time without a memory map.
"""

from __future__ import annotations

import json
import time
from collections.abc import Collection
from dataclasses import asdict
from pathlib import Path

import torch
import torch.nn as nn

from mfgguf.config import EXPERT_INITS, ModelConfig
from mfgguf.data.masks import load_mask
from mfgguf.errors import MfggufError
from mfgguf.model import SEED_FFN, Transformer, share_tied_embedding, trunk_name_map
from mfgguf.options import TrainOptions
from mfgguf.plots import loss_curve
from mfgguf.run.records import ModuleMeta
from mfgguf.run import RunDir, current_trunk, module_name, read_module, write_module
from mfgguf.train.engine import checkpoint as ckpt_io
from mfgguf.train.engine.driver import smooth
from mfgguf.train.engine.loop import (check_token_range, evaluate, validation_losses, limit_heap_retention, load_tokens,
                                      resolve_device, resolve_precision, result_meta, run_loop, schedule_steps)
from mfgguf.train.engine.records import Checkpoints, Drive, StepSetup
from mfgguf.train.engine.weights import read_safetensors, set_param
from mfgguf.train.experts import pieces as pc
from mfgguf.train.experts.base_score import reference_validation_loss
from mfgguf.train.experts.config import expert_config
from mfgguf.train.experts.pieces import expert_params  # noqa: F401  (the expert's trainable parameters, as before)
from mfgguf.train.experts.stats import RouterStats, stats_tokens
from mfgguf.train.experts.tailstats import TailStats, moments_path, write_moments
from mfgguf.train.rounds.ends import round_end
from mfgguf.train.whole.trunk import plan_activations



def build_expert_model(rd: RunDir, cfg: ModelConfig, seed: int, dev: torch.device, bf16_trunk: bool,
                       init: str = "random", trainable: Collection[str] = (), trunk_path: Path | None = None) -> Transformer:
    """Transformer(cfg, n_experts=1): frozen trunk from the module file, trainable expert 0 (zero down-proj).

    `trainable` names trunk parameters loaded instead as trainable f32 copies (`--shared`, see shared.py).
    `trunk_path` reads another trunk file than RUN's (a sync's merged trunk before it is published).

    Built on the meta device and filled tensor by tensor, so no f32 copy of the whole trunk exists.
    init="seed" starts the whole expert from the trunk's seed FFN, so step 0 computes exactly the
    trunk alone (anchor + seed); "auto" is seed when the trunk has one, else random. "anchor" starts
    gate/up from the anchor's first expert_ff rows (tiled if the expert is wider): features the
    trunk already uses. random and anchor have a zero down-projection, so step 0 computes the anchor.
    """
    if init not in EXPERT_INITS:  # a caller's own string (TrainConfig has checked its expert_init)
        raise MfggufError(f"unknown --init {init!r}; choose one of {', '.join(EXPERT_INITS)}")
    if init == "auto":
        init = "seed" if cfg.seed_expert else "random"
    if init == "seed" and not cfg.seed_expert:
        raise MfggufError("--init seed needs a trunk trained with a seed FFN; retrain it with"
                          " `mfgguf train-trunk RUN --seed-expert`, or use --init random")
    seed_ffn = {}
    with torch.device("meta"):
        model = Transformer(cfg, n_experts=1)
    linear = {n + ".weight" for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    by_gguf = {g: n for n, g in trunk_name_map(cfg.n_layers, cfg.family).items()}
    for gname, t in read_safetensors(trunk_path or rd.module_file(0)):
        name = by_gguf.get(gname)
        if name is None:
            if init == "seed" and gname.endswith("_seed.weight"):
                seed_ffn[gname] = t
            continue
        want = tuple(model.get_parameter(name).shape)
        if tuple(t.shape) != want:
            raise MfggufError(f"trunk tensor {gname} has shape {tuple(t.shape)}, its config says {want}; retrain the trunk")
        train = name in trainable
        dtype = torch.bfloat16 if bf16_trunk and name in linear and not train else torch.float32  # norms, embedding f32
        set_param(model, name, t.to(dev, dtype), requires_grad=train)
    g = torch.Generator().manual_seed(seed)
    for l, layer in enumerate(model.layers):
        e = layer.experts[0]
        if init == "seed":
            for part in ("gate", "up", "down"):
                w = seed_ffn.get(SEED_FFN.format(l=l, f=part))
                if w is None:
                    raise MfggufError(f"the trunk file has no seed tensor {SEED_FFN.format(l=l, f=part)}; retrain the trunk")
                set_param(model, f"layers.{l}.experts.0.{part}.weight", w.to(dev, torch.float32).clone(), True)
            set_param(model, f"layers.{l}.router", torch.zeros(layer.router.shape, device=dev), False)
            continue
        for part in ("gate", "up"):  # random: same init as Transformer.reset_parameters
            w = torch.empty(getattr(e, part).weight.shape).normal_(0.0, 0.02, generator=g)  # (expert_ff, dim)
            if init == "anchor":
                a = getattr(layer.anchor, part).weight.detach().float().cpu()  # (anchor_ff, dim)
                w = a.repeat(-(-cfg.expert_ff // cfg.anchor_ff), 1)[: cfg.expert_ff].clone()  # (expert_ff, dim)
            set_param(model, f"layers.{l}.experts.0.{part}.weight", w.to(dev), True)
        set_param(model, f"layers.{l}.experts.0.down.weight", torch.zeros(e.down.weight.shape, device=dev), True)
        set_param(model, f"layers.{l}.router", torch.zeros(layer.router.shape, device=dev), False)
    left = [n for n, p in model.named_parameters() if p.is_meta]
    if left:
        raise MfggufError(f"trunk file lacks {len(left)} tensor(s), e.g. {left[0]}; retrain the trunk")
    share_tied_embedding(model)  # a tied bf16 base keeps one table, not an f32 one beside its head
    return model


def train_expert(run: Path, expert: int, *, options: TrainOptions = TrainOptions(), device: str = "cpu",
                 progress: bool = True, precision: str = "auto", restart: bool = False,
                 recompute: bool | None = None) -> dict:
    """Train expert EXPERT (1..N) alone on its shard with the trunk frozen; write modules/expert_00I.

    The expert is one SwiGLU FFN per layer added beside the anchor; it starts as a no-op and only
    its parameters train. The last training steps that cover --stats-tokens record the router
    statistics (per layer: the mean of the FFN-input vectors) into the module file; --stats-from
    pass measures them by a pass over the shard after training instead (slower, a little better
    routed: docs/studies/speed.md). Resumes
    from RUN/checkpoints/expert_00I if a compatible checkpoint is there (--restart deletes it).
    `options` change the trunk's preset's expert TrainConfig (tokens, lr, batch_size, seed, ...).

    --shared norms|attn|all also trains a private f32 copy of those trunk tensors (the norms;
    + attention; the whole trunk), at peak LR lr * --shared-lr-scale, stored in the module file as
    shared.<trunk tensor name> for assembly (or `mfgguf sync`) to merge. Default none: the FFN only.

    --rounds R (with --shared) cuts the schedule into R rounds: each call trains the next round and
    keeps its checkpoint; `mfgguf sync RUN` between rounds merges every expert's shared copies into
    the trunk the next round starts from.

    Example:
        >>> train_expert(Path("RUN"), 1, options=TrainOptions(tokens=20_000))["validation_loss"]
    """
    t_start = time.perf_counter()
    job = open_job(Path(run), int(expert), options, device, precision)
    tc, cfg, rd, i = job.tc, job.cfg, job.rd, job.i
    t = time.perf_counter()  # before the expert's model exists: an imported base is scored by a model of its own
    before = reference_validation_loss(rd, job.trunk, tc.eval_tokens, job.dev, job.prec) if job.rnd == tc.rounds else {}
    clock = {"setup": t - t_start, "base_validation": time.perf_counter() - t}  # where the wall time goes, in seconds
    ckpt_dir = rd.checkpoint_dir(i)
    if restart:
        ckpt_io.remove(ckpt_dir)
    rec, micro = plan_activations(cfg, tc.batch_size) if recompute is None else (recompute, tc.batch_size)
    if rec:  # the memory-bound regime (a big trunk): keep freed buffers out of RSS
        limit_heap_retention()
    ffn, shared = pc.PlainFfn(), pc.SharedCopies(cfg, tc)
    model = _build(job, ffn, shared)
    named = {**ffn.params(model), **shared.params(model)}
    ckpt_meta = {"module": module_name(i), "kind": "expert", "preset": job.preset, "model": cfg.to_dict(),
                 "train": asdict(tc), "trunk_sha256": job.trunk.sha256}
    steps, state = schedule_steps(tc, cfg.ctx_len), ckpt_io.peek(ckpt_dir)
    start_state = pc.BranchStart.state(job, named, ffn, state)
    resume_from, keep = pc.RoundStart.plan(job, ckpt_meta, state, ckpt_dir, steps, shared)
    until = round_end(steps, tc.rounds, job.rnd)
    tail = pc.statistics(cfg, tc, steps) if until == steps else None  # the last round gathers the router statistics
    curve = lambda: validation_losses(rd.validation_dir, model, tc.curve_tokens, ffn.route, job.dev, job.prec)  # noqa: E731
    setup = StepSetup(job.dev, job.prec, ffn.route, recompute=rec, micro=micro, lr_scale=shared.lr_scales(model))
    drive = Drive(stream=i, label=_label(i, job.rnd, tc.rounds), progress=progress, validation=curve, until=until,
                  mask=load_mask(rd.shard(i), len(job.data)))
    ckpt = Checkpoints(ckpt_dir, ckpt_meta, keep=keep, resume_from=resume_from)
    res = run_loop(model, named, job.data, tc, setup=setup, ckpt=ckpt, drive=drive, start_state=start_state, tail=tail)
    if job.rnd < tc.rounds:
        return _write_round(job, model, res, ffn, shared, setup, t_start)
    meta = _finish(job, model, res, ffn, shared, tail, setup, t_start, clock, before)
    ckpt_io.remove(ckpt_dir)
    return meta


def open_job(run: Path, expert: int, options: TrainOptions, device: str, precision: str) -> pc.Job:
    """Read and check everything an expert job needs before any model exists: the run, the trunk, the
    options over the trunk's preset, the round, the device and the shard."""
    options.check("expert", "train-expert")
    rd = RunDir(run)
    info = rd.run_info()
    i = rd.check_expert_index(expert)
    trunk = current_trunk(rd)
    ec = expert_config(trunk, options)
    cfg, tc, preset = ec.cfg, ec.tc, ec.preset
    pc.SharedCopies(cfg, tc).check()
    rnd = _round(rd, trunk, tc, i)
    dev = resolve_device(device)
    prec = resolve_precision(precision, dev)
    data = load_tokens(rd.shard(i), f"shard {i}")
    check_token_range(data, cfg.vocab_size, str(rd.shard(i)))
    return pc.Job(rd, i, info, trunk, cfg, preset, tc, rnd, dev, prec, data)


def _build(job: pc.Job, ffn: pc.PlainFfn, shared: pc.SharedCopies) -> Transformer:
    """The expert's model: frozen trunk, the FFN piece's expert, shared copies."""
    return build_expert_model(job.rd, job.cfg, job.tc.seed + job.i, job.dev, bf16_trunk=job.bf16_trunk,
                              init=job.tc.expert_init, trainable=shared.names())


def _finish(job: pc.Job, model, res, ffn: pc.PlainFfn, shared: pc.SharedCopies, tail: TailStats | None,
            setup: StepSetup, t_start: float, clock: dict, before: dict) -> dict:
    """The last round's module: its validation score, router statistics, record, tensors and loss curve."""
    tc, cfg, rd, i = job.tc, job.cfg, job.rd, job.i
    t = time.perf_counter()
    last = res.validation_history[-1] if res.validation_history else None
    if last is not None and last[0] == res.steps and tc.curve_tokens >= tc.eval_tokens:
        validation = last[2]  # the curve's last point scored the same tokens a moment ago
    else:
        validation = validation_losses(rd.validation_dir, model, tc.eval_tokens, ffn.route, job.dev, job.prec)
    t1 = time.perf_counter()
    if tail is not None:  # the training steps' own FFN inputs; the shard loss is theirs too
        stats, shard_loss = tail.stats, smooth(res.history, res.steps - tail.first_step)
    else:
        stats = RouterStats(cfg.n_layers, cfg.dim)
        shard_loss, _ = evaluate(model, job.data, stats_tokens(asdict(tc)), ffn.route, job.dev, job.prec,
                                 hook=stats.hook)
    clock.update(validation=t1 - t, stats=time.perf_counter() - t1)
    meta = {
        **result_meta(res, kind="expert", preset=job.preset, cfg=cfg, tc=tc, info=job.info, setup=setup,
                      validation=validation, t_start=t_start),
        "index": i,
        "micro_batch": setup.micro,
        "trunk_sha256": job.trunk.sha256,
        "shard": i,
        "shard_domains": job.info.shard_domains(i),
        "shard_loss": shard_loss,
        "trunk_validation_loss": before,
        "router_stats_count": stats.n,
        "router_stats_from": "pass" if tail is None else f"training steps {tail.first_step + 1}-{res.steps}",
        "wall_breakdown_s": {**{k: round(v, 2) for k, v in clock.items()}, "train": round(res.train_s, 2),
                             "curve": round(res.eval_s, 2)},
        **shared.record(), "round": job.rnd, "rounds": tc.rounds, **pc.BranchStart.record(job),
    }
    means = {k: v for k, v in stats.tensors().items() if k.endswith(".mean")}  # the module keeps its means only

    def moments(sha256: str) -> None:  # before the record: a trained expert always has its moments
        if stats.sq is not None:  # the pooled G takes them instead of a pass (pooled.py, rounds/adopt.py)
            write_moments(rd, i, stats, sha256)
        else:  # an earlier module's would only take disk: they name a module that is gone
            moments_path(rd, i).unlink(missing_ok=True)

    meta = write_module(rd, i, {**ffn.tensors(model), **shared.tensors(model), **means}, meta, beside=moments)
    loss_curve(rd.plots / f"loss_{module_name(i)}.png", res.history, validation=validation, curve=res.validation_history,
               reference=before or None, title=f"{module_name(i)} ({job.preset}, {res.tokens_seen:,} tokens)")
    return meta


def _round(rd: RunDir, trunk: ModuleMeta, tc, i: int) -> int:
    """Which round (1..R) this job trains: one more than the syncs the trunk has been through."""
    if not (isinstance(tc.rounds, int) and tc.rounds >= 1):
        raise MfggufError(f"--rounds must be a whole number >= 1, got {tc.rounds}")
    if tc.rounds > 1 and tc.shared == "none":
        raise MfggufError("--rounds > 1 needs experts that train shared tensors (--shared norms|attn|all):"
                          " with --shared none there is nothing to sync between rounds")
    if trunk.final:
        synced = trunk.sync_experts
        if synced and i not in synced and tc.shared == "none" and tc.rounds == 1:
            return 1  # an expert that sat out the syncs: a plain one on the final trunk, for `extend` or assembly
        raise MfggufError(f"{rd.root} is synced after its last round; its experts are final: assemble it"
                          + (f" (an expert that sat out the syncs, not {i}, may train later with --shared none)"
                             if synced else ""))
    rnd = trunk.syncs + 1
    if rnd > tc.rounds:
        raise MfggufError(f"the trunk has been through {rnd - 1} sync(s), so expert {i} would train round {rnd},"
                          f" but --rounds is {tc.rounds}; pass the --rounds the run was started with")
    return rnd


def _label(i: int, rnd: int, rounds: int) -> str:
    return module_name(i) if rounds == 1 else f"{module_name(i)} round {rnd}/{rounds}"


def _write_round(job: pc.Job, model, res, ffn: pc.PlainFfn, shared: pc.SharedCopies, setup: StepSetup,
                 t_start: float) -> dict:
    """The module file after a round that is not the last: FFNs + shared copies for `mfgguf sync`.

    No router statistics (the next round changes them); the checkpoint stays for the next round.
    """
    last = res.validation_history[-1] if res.validation_history else None
    validation = last[2] if last is not None and last[0] == res.steps else {}  # a round's end is not scored
    i, tc = job.i, job.tc
    meta = {
        **result_meta(res, kind="expert", preset=job.preset, cfg=job.cfg, tc=tc, info=job.info, setup=setup,
                      validation=validation, t_start=t_start),
        "index": i, "trunk_sha256": job.trunk.sha256, "shard": i, "shard_domains": job.info.shard_domains(i),
        "trunk_validation_loss": job.trunk.validation_loss, "router_stats_count": 0,
        **shared.record(), "round": job.rnd, "rounds": tc.rounds,
        **pc.BranchStart.record(job),
    }
    return write_module(job.rd, i, {**ffn.tensors(model), **shared.tensors(model)}, meta)


if __name__ == "__main__":  # python -m mfgguf.train.experts.expert RUN I: the CLI verb without typer
    import sys

    print(json.dumps({k: v for k, v in train_expert(Path(sys.argv[1]), int(sys.argv[2])).items() if k != "history"}))
