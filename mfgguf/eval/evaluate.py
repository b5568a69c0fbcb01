"""`mfgguf eval RUN`: does assembling independently trained modules, without retraining, work?

Every figure is measured by llama.cpp on a GGUF written by `mfgguf assemble`, on the test split
no module trained on and no choice looked at (every choice -- the MoE's router and top-k, the
oracle's experts, the baselines' LRs and schedules -- reads the validation split; a RUN prepared
before validation existed has one held-out split for both, and the report says so):
  - the assembled MoE for each router method, top-1 and top-2 (at `base_quant`, f16 by default), each with the
    seed gate (`--seed-gates`, or none) validation chose: the gates it turned down are scored on validation only;
  - the trunk alone (anchor only, no experts);
  - oracle routing: each domain's text through a model holding only its best expert;
  - dense baselines trained from scratch with the same code on the union of all shards, budgeted
    in training FLOPs (eval/baselines/scratch.py, eval/training_flops.py): FLOP-matched and wall-clock-matched
    with the MoE's active parameters per token, and optionally FLOP-matched with its total ones;
    on an imported base instead, the base itself trained further on the experts' data: continued
    pretraining (FLOP- and wall-clock-matched) and a peft LoRA (FLOP-matched), each with its LR
    from a small grid (eval/baselines/imported.py), and only the experts trained so far;
  - q8_0 and q4_k against f16 of the assembled MoE with the best router;
  - on an imported base with per-domain LoRAs (lora-domain), the same adapters where the client does not
    know a document's domain (each document served by the candidate of lowest loss on its first 128
    tokens, eval/domain_stream.py), and the best MoE on the same documents and tokens.
Plus per-layer routing accuracy (from the PyTorch reference with the same router weights),
llama.cpp prompt/decode tokens/s and peak RSS per model (each model in its own process), and the
held-out loss curves of the trunk and every baseline against tokens and training FLOPs.
Writes report.md, report.json and PNG plots into RUN/eval/ (or `out`).

This file runs the comparison as a sequence of phases over one `Evaluation`, which assembles every
GGUF (again only when its source changed since); eval/baselines/ trains the baselines of either
side behind one interface, eval/measure.py measures one model (and the routing), eval/report.py
writes the report against its goals (`Goals`), eval/plots.py draws its figures.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from pathlib import Path

from mfgguf.errors import MfggufError
from mfgguf.eval.baselines.baseline import SECTIONS, Job, Outcome
from mfgguf.eval.baselines.imported import first_trunk_view
from mfgguf.eval.baselines.sides import side_for
from mfgguf.eval.domain_stream import stream_candidates
from mfgguf.eval.general import check_benchmarks, score_general, with_questions
from mfgguf.eval.measure import measure, measure_stream, mixed, routing_accuracy
from mfgguf.eval.measured import file_key, kept
from mfgguf.eval.plots import eval_plots
from mfgguf.eval.report import Goals, curves, goals, recipe, report_markdown
from mfgguf.eval.spread import spreads
from mfgguf.eval.training_flops import flops_section
from mfgguf.run import ModuleMeta, RunDir, read_module, router_stats_current, write_json, write_text

STATS_ROUTERS = ("ridge", "centroid")  # routers computed from the experts' statistics (uniform, random: controls)


@dataclass(frozen=True)
class EvalConfig:
    routers: tuple[str, ...] = ("ridge", "centroid", "uniform", "random")  # router methods compared
    top_ks: tuple[int, ...] = (1, 2)  # experts per token compared
    seed_gates: tuple[float, ...] = ()  # ridge MoEs with the seed routed too (`assemble --seed-gate`), at each top-k
    base_quant: str = "f16"  # the reference type every comparison uses
    quants: tuple[str, ...] = ("q8_0", "q4_k")  # compared against base_quant for the best router
    dense: bool = True  # train dense baselines at all (the longest step); False = none (--no-dense)
    baselines: tuple[str, ...] | None = None  # which: flop, wallclock, total; None = flop + wallclock (+ total
    #                                           while anchor_ff + N * expert_ff <= 4 x anchor_ff)
    dense_schedules: tuple[str, ...] = ("cosine", "wsd")  # LR schedules each dense baseline trains with; the
    #                                                        better held-out loss is kept (one: half the dense time)
    max_tokens_per_domain: int = 32768  # held-out tokens scored per domain (bounds the run time)
    ctx: int | None = None  # perplexity window; None = 1,024 or the model's context where shorter (runtime/perplexity.py)
    decode_tokens: int = 64  # tokens generated to measure decode speed
    seed: int | None = None  # the baselines' training seed (the experts' is train-expert's); None: each side's default
    baseline_lrs: dict[str, tuple[float, ...]] | None = None  # an imported base's LR grids {"full": ..., "lora": ...}
    #                                                            where not eval/baselines/imported.py's GRID
    benchmarks: dict[str, str] | None = None  # {hellaswag|winogrande|multiple-choice: its file}: every final model
    #                                           scored on it (eval/general.py); None = none
    benchmark_tasks: dict[str, int | None] | None = None  # tasks of each benchmark (eval/general.py's EVAL_TASKS
    #                                                        where not given)
    questions: bool = True  # also score the RUN's question sets (RUN/questions/, `mfgguf questions`) as benchmarks
    budget_flops: dict[int, float] | None = None  # {shard: FLOPs}: an imported base's baselines alone, at these FLOPs
    #                                               instead of trained experts' (eval/baselines/budgeted.py)


def evaluate(run: Path, out: Path | None = None, cfg: EvalConfig = EvalConfig(), *, force: bool = False,
             target: Goals = Goals()) -> dict:
    """Compare the assembled MoE against the trunk alone, oracle routing and FLOP- and wall-clock-matched dense models.

    Perplexity per domain and on the mixed held-out set, measured by llama.cpp on GGUFs written
    by `mfgguf assemble`; routing accuracy per layer; q8_0/q4_k against f16; tokens/s and peak
    RSS per model. Writes report.md (tables, each goal checked against `target`), report.json (raw
    figures) and PNG plots.
    """
    cfg = with_questions(cfg, Path(run))
    check_benchmarks(cfg.benchmarks, cfg.benchmark_tasks)
    ev = _open(Path(run), out, cfg, force)
    t_start = time.perf_counter()
    models = _assembled_models(ev)
    baselines = train_baselines(ev)
    models.update(baseline_models(ev, baselines))
    validation = _choose_on_validation(ev, models)
    best = min(validation, key=lambda k: validation[k]["overall"]["ppl"])
    scored = finalists(models, validation)
    results = _measure_all(ev, {k: m for k, m in models.items() if m["kind"] != "moe" or k in scored})
    quant_rows = _quantized(ev, models, results, best)
    stream = _domain_stream(ev, models, best)
    general = score_general(ev, models, scored, say=_say) if cfg.benchmarks else {}
    _say("routing accuracy")
    routing = {r: routing_accuracy(ev.rd, ev.domains, ev.test, _moe_gguf(ev, cfg.base_quant, r, 1)) for r in cfg.routers}
    report = _report(ev, models, results, validation, best, quant_rows, routing, baselines, stream)
    if general:
        report["general"] = general
    if grid_scale := _on_grid_scale(ev, models[best]["path"], best, baselines):
        report["moe_on_grid_scale"] = grid_scale
    report["wall_s"] = round(time.perf_counter() - t_start, 1)
    write_json(ev.out / "report.json", report)
    eval_plots(report, ev.out)
    write_text(ev.out / "report.md", report_markdown(report, target))
    return report


# ---- phases ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Evaluation:
    """What every phase reads: the RUN, the experts in the MoE, the held-out data, where models go."""

    rd: RunDir
    cfg: EvalConfig
    force: bool
    metas: dict[int, ModuleMeta]  # {0: the trunk's record, i: expert i's}, the experts trained (so far)
    subset: list[int] | None  # the experts in the MoE when not all of them (an imported base's forgetting test)
    test: dict  # domain -> test tokens (routing accuracy)
    out: Path

    @property
    def domains(self) -> list[str]:
        return list(self.test)  # domains with a held-out split

    def gguf(self, name: str, *, run: Path | None = None, since: Path | None = None, **kw) -> Path:
        """out/models/<name>.gguf assembled from `run` (default: this RUN, the MoE's experts), the one place a model
        is built: again only when forced, missing, or older than `since` (default: this RUN's manifest, which
        every retrained module updates; for another `run`, only what the caller names)."""
        from mfgguf.converters.assemble import assemble

        path = self.out / "models" / f"{name}.gguf"
        since = since if since is not None or run is not None else self.rd.manifest
        if self.force or not path.is_file() or (since is not None and path.stat().st_mtime < since.stat().st_mtime):
            _say(f"assemble {name}")
            assemble(run or self.rd.root, path, force=True, progress=False, **{"experts": self.subset, **kw})
        return path


def _open(run: Path, out: Path | None, cfg: EvalConfig, force: bool) -> Evaluation:
    """The RUN's experts trained so far (an imported base may have some missing), their router statistics made
    current, the held-out data, and the output folder."""
    rd = RunDir(run)
    n = rd.run_info().n_experts
    trunk = read_module(rd, 0)
    base = trunk.source == "base"
    # on an imported base, the experts trained so far (a held-out domain may have none: the forgetting test)
    ids = [i for i in range(1, n + 1) if not base or rd.module_meta(i).is_file()]
    if not ids:
        raise MfggufError(f"{rd.root} has no trained expert; train one with `mfgguf train-expert {rd.root} --expert 1`")
    subset = ids if len(ids) < n else None
    if subset:
        _say(f"experts {','.join(map(str, ids))} are trained: the MoE holds those")
    metas = {0: trunk, **{i: read_module(rd, i) for i in ids}}
    if "ridge" in cfg.routers and not router_stats_current(rd, subset):
        from mfgguf.train.experts.pooled import pool_router_stats

        _say("router statistics (mfgguf router-stats)")  # the ridge router needs them; stale or missing here
        pool_router_stats(rd.root, progress=False, experts=subset)
    test = rd.test_tokens(cfg.max_tokens_per_domain)
    check_windows(rd, cfg.ctx, cfg.max_tokens_per_domain)
    out = Path(out) if out else rd.root / "eval"
    (out / "models").mkdir(parents=True, exist_ok=True)
    return Evaluation(rd, cfg, force, metas, subset, test, out)


def check_windows(rd: RunDir, ctx: int | None = None, cap: int | None = None) -> None:
    """Every domain's test and validation text (its first `cap` tokens) must fill one perplexity window (`ctx`, else
    eval's default for this RUN's models), or nothing of it could be scored: one line, before anything trains (a
    split too short stopped eval only when it came to score, after its baselines had trained)."""
    from mfgguf.base.runbase import imported
    from mfgguf.runtime.perplexity import WINDOW

    base = imported(rd.root)  # an imported base's files keep its own context length, as assembly writes it
    window = ctx or min(WINDOW, base.gguf_kv()[2] if base else int(read_module(rd, 0).config["ctx_len"]))
    test = rd.test_tokens(cap)
    for split, toks in (("test", test), ("validation", rd.validation_tokens(cap))):
        short = {d: len(t) for d, t in toks.items() if d in test and len(t) < window}
        if short:
            d, n = min(short.items(), key=lambda x: x[1])
            raise MfggufError(f"domain {d!r} has {n} {split} tokens, fewer than one perplexity window of {window}"
                              f" ({len(short)} domain(s) so); pass --ctx {max(n, 2)} or less (and --max-tokens at"
                              " least that), or prepare the RUN with more text a domain or a larger"
                              " --test-frac / --valid-frac")


def train_baselines(ev: Evaluation) -> Outcome:
    """The baselines of the trunk's side (from scratch, or an imported base trained further), trained or reused."""
    cfg = ev.cfg
    job = Job(ev.rd, ev.metas, ev.out, which=cfg.baselines if cfg.dense else (), force=ev.force,
              schedules=cfg.dense_schedules if cfg.dense else None, seed=cfg.seed, lrs=cfg.baseline_lrs)
    return side_for(ev.metas[0]).train(job)


def _assembled_models(ev: Evaluation) -> dict[str, dict]:
    """name -> {"path", "kind", ...; "domains" where it is scored on some only}: every MoE compared, the trunk
    alone (and as trained, before a sync merged it) and each domain's oracle."""
    q, n = ev.cfg.base_quant, ev.rd.run_info().n_experts
    models = {f"moe {router} top-{k}": {"path": _moe_gguf(ev, q, router, k), "kind": "moe", "router": router, "top_k": k}
              for router in ev.cfg.routers for k in ev.cfg.top_ks if k <= n}
    for c in ev.cfg.seed_gates:  # the seed as routed expert 0 beside the experts: one more slot
        for k in ev.cfg.top_ks:
            models[f"moe ridge seed-gate {c:g} top-{k}"] = {"path": _moe_gguf(ev, q, "ridge", k, c), "kind": "moe",
                                                           "router": "ridge", "top_k": k, "seed_gate": c}
    models["trunk alone"] = {"path": ev.gguf(f"trunk-{q}", quant=q, experts=[]), "kind": "trunk"}
    trained = first_trunk_view(ev.rd, ev.out)  # after `mfgguf sync` the trunk alone is the merged one
    if trained is not None:
        models["trunk as trained (before sync)"] = {"path": ev.gguf(f"trunk-trained-{q}", run=trained.root, quant=q,
                                                                    experts=[]), "kind": "trunk"}
    for d, e in _best_expert_per_domain(ev.metas, ev.domains).items():
        models[f"oracle {d}"] = {"path": ev.gguf(f"oracle-{d}-{q}", quant=q, experts=[e]),
                                 "kind": "oracle", "domains": [d], "expert": e}
    return models


def _moe_gguf(ev: Evaluation, quant: str, router: str, top_k: int, seed_gate: float | None = None) -> Path:
    """The MoE with this router and top-k (and seed gate) at `quant`, as every phase names and builds it."""
    gate = "" if seed_gate is None else f"-seed{seed_gate:g}"
    return ev.gguf(f"moe-{router}{gate}-top{top_k}-{quant}", quant=quant, router=router, top_k=top_k, seed_gate=seed_gate)


def baseline_models(ev: Evaluation, baselines: Outcome) -> dict[str, dict]:
    """Each trained baseline's trunk alone, assembled when it (or, for the per-domain LoRAs, an adapter served on it)
    was trained since: a base GGUF older than its adapters may be of another trunk than the one they trained from."""
    q = ev.cfg.base_quant

    def since(t) -> Path:
        return max([RunDir(t.run).module_file(0), *map(Path, t.row.get("adapters", {}).values())],
                   key=lambda f: f.stat().st_mtime)

    return {t.label: {"path": ev.gguf(f"{t.gguf}-{q}", run=t.run, since=since(t), quant=q, experts=[]), **t.row}
            for t in baselines.trained}


def finalists(models: dict, validation: dict) -> set[str]:
    """The MoEs the test split scores: of each router and top-k, the seed gate (or none) of lowest validation
    perplexity. A gate validation turned down is a choice, not a final model, so test never sees it."""
    groups: dict[tuple, list[str]] = {}
    for k in validation:
        groups.setdefault((models[k]["router"], models[k]["top_k"]), []).append(k)
    return {min(g, key=lambda k: validation[k]["overall"]["ppl"]) for g in groups.values()}


def _measure_all(ev: Evaluation, models: dict) -> dict[str, dict]:
    """Every model given on the test split, each on the domains it is for."""
    results = {}
    for name, m in models.items():
        _say(f"measure {name}")
        results[name] = measure_model(ev, m["path"], m.get("domains", ev.domains), adapters=m.get("adapters"))
    return results


def _choose_on_validation(ev: Evaluation, models: dict) -> dict[str, dict]:
    """The choices made among the assembled models (which router, top-k and seed gate is "the MoE"; which seed gate
    each router and top-k keeps) read validation, every MoE assembled scored on it."""
    validation = {}
    for k in [k for k, m in models.items() if m["kind"] == "moe"]:
        _say(f"measure {k} on validation")
        validation[k] = measure_model(ev, models[k]["path"], ev.domains, split="validation")
    return validation


def _quantized(ev: Evaluation, models: dict, results: dict, best: str) -> dict[str, dict]:
    """The best MoE at each quant type compared (and at base_quant), added to `models` and `results`."""
    router, k, c = models[best]["router"], models[best]["top_k"], models[best].get("seed_gate")
    rows = {ev.cfg.base_quant: results[best]}
    for q in ev.cfg.quants:
        path = _moe_gguf(ev, q, router, k, c)
        _say(f"measure {best} {q}")
        rows[q] = results[f"{best} {q}"] = measure_model(ev, path, ev.domains)
        models[f"{best} {q}"] = {"path": path, "kind": "quant"}
    return rows


def _domain_stream(ev: Evaluation, models: dict, best: str) -> dict:
    """The per-domain LoRAs with the domain unknown (eval/domain_stream.py), and the best MoE, which needs no choice,
    on the same documents and tokens of the test split: {"lora": label, "moe": best, "results": {label: figures}};
    {} without per-domain LoRAs."""
    lora = next((k for k, m in models.items() if m.get("adapters")), None)
    if lora is None:
        return {}
    candidates, own = stream_candidates(models[lora]["adapters"], models[lora].get("every_adapter", ()))
    results = {}
    for name, cands, mine in ((lora, candidates, own), (best, {best: None}, None)):
        _say(f"measure {name} on the unknown-domain stream")
        path, cfg = models[name]["path"], ev.cfg
        settings = {"split": "test", "domains": ev.domains, "max_tokens": cfg.max_tokens_per_domain, "ctx": cfg.ctx,
                    "candidates": {k: v and file_key(v) for k, v in cands.items()}, "own": mine}
        results[name] = kept(ev.out, path, settings, lambda: measure_stream(
            path, ev.rd, ev.domains, max_tokens=cfg.max_tokens_per_domain, ctx=cfg.ctx, candidates=cands, own=mine),
            force=ev.force, what="stream")
    return {"lora": lora, "moe": best, "results": results}


def _on_grid_scale(ev: Evaluation, path: Path, best: str, baselines: Outcome) -> dict:
    """The MoE validation chose, scored as the baselines' LR grid scored its points (PyTorch on the grid runs' own
    validation tokens a domain: eval/reference_validation.py), so the served MoE and every grid point share one
    measure: {"model", "eval_tokens", "loss": {domain: nats}, "mean_trained", "grid"}; {} without an LR grid."""
    from mfgguf.eval.reference_validation import reference_validation

    section = baselines.sections.get("base_baselines") or {}
    # a grid of one LR that only the per-cluster LoRAs use is never run (imported.py): no point to set the MoE beside
    if not any(g["validation_loss_trained_domains"] for g in (section.get("grid") or {}).values()) or not baselines.trained:
        return {}
    m = read_module(RunDir(baselines.trained[0].run), 0)  # every grid run scores alike (train-base)
    tokens, precision = m.eval_tokens, str(m.precision)
    _say(f"measure {best} on validation as the LR grids are scored")
    loss = kept(ev.out, path, {"split": "validation", "eval_tokens": tokens, "precision": precision},
                lambda: reference_validation(ev.rd, path, tokens, precision=precision), force=ev.force, what="pytorch")
    trained = section["trained_domains"]
    return {"model": best, "eval_tokens": tokens, "precision": precision, "loss": loss,
            "mean_trained": sum(loss[d] for d in trained) / len(trained), "trained_domains": trained,
            "grid": {mode: g["validation_loss_trained_domains"] for mode, g in section["grid"].items()},
            "chosen_lr": {mode: g["chosen_lr"] for mode, g in section["grid"].items()}}


def _report(ev: Evaluation, models: dict, results: dict, validation: dict, best: str, quant_rows: dict,
            routing: dict, baselines: Outcome, stream: dict) -> dict:
    """report.json's content (all but its wall time): every figure measured, the choices and what they read."""
    cfg, metas, domains = ev.cfg, ev.metas, ev.domains
    oracle_experts = _best_expert_per_domain(metas, domains)
    oracle = {d: results[f"oracle {d}"]["domains"][d] for d in domains}  # each domain through its own expert
    oracle_mixed = mixed(oracle)
    stats_moe = [k for k in validation if models[k]["router"] in STATS_ROUTERS]
    best_stats = min(stats_moe, key=lambda k: validation[k]["overall"]["ppl"]) if stats_moe else None
    return {
        "run": str(ev.rd.root),
        "config": asdict(cfg),
        "domains": domains,
        "models": {k: {**{kk: vv for kk, vv in m.items() if kk != "path"}, "file": m["path"].name,
                       "bytes": m["path"].stat().st_size} for k, m in models.items()},
        "results": results,
        "splits": {**ev.rd.split_roles(), "chosen_on_validation": ["best router and top-k", "oracle experts",
                                                                   "baseline LRs and schedules", "training curves"]},
        "validation": {k: v["overall"] for k, v in validation.items()},
        "oracle": {"experts": oracle_experts, "mixed": oracle_mixed},
        "recipe": recipe(metas),
        "best": best,
        "best_stats_router": best_stats,
        "quant": {q: r["overall"]["ppl"] for q, r in quant_rows.items()},
        "routing": routing,
        "goals": goals(results, best, best_stats, oracle_mixed, quant_rows, cfg.base_quant, cfg.quants, domains,
                       baselines.trained, stream),
        **({"domain_stream": stream} if stream else {}),
        "test_spread": spreads(results[best]["domains"],
                               {**{p.key: results[p.label]["domains"] for p in baselines.trained}, "oracle": oracle}, domains),
        "flops": flops_section(metas, baselines.trained),
        **{**SECTIONS, **baselines.sections},
        "curves": curves(metas[0], baselines.curves),
    }


# ---- models ------------------------------------------------------------------------------------


def _best_expert_per_domain(metas: dict[int, ModuleMeta], domains: list[str]) -> dict[str, int]:
    """The oracle's choice: for each domain the expert with the lowest held-out loss on it."""
    best = {}
    for d in domains:
        losses = {i: m.validation_loss[d] for i, m in metas.items() if i > 0 and d in m.validation_loss}
        if not losses:
            raise MfggufError(f"no expert recorded a held-out loss on domain {d!r}; retrain the experts with this mfgguf")
        best[d] = min(losses, key=losses.get)
    return best


def measure_model(ev: Evaluation, path: Path, domains: list[str], split: str = "test",
             adapters: dict[str, str] | None = None) -> dict:
    """One GGUF's figures on `split`, or the ones an earlier eval stored for the same file and settings (measured.py)."""
    cfg = ev.cfg
    decode = cfg.decode_tokens if split == "test" else 0
    settings = {"split": split, "domains": list(domains), "max_tokens": cfg.max_tokens_per_domain, "ctx": cfg.ctx,
                "decode_tokens": decode, "adapters": {d: file_key(a) for d, a in (adapters or {}).items()},
                **({"documents": True} if split == "test" else {})}  # test keeps each document's NLL (spread.py)
    return kept(ev.out, path, settings, lambda: measure(path, ev.rd, domains, max_tokens=cfg.max_tokens_per_domain,
                                                        ctx=cfg.ctx, decode_tokens=decode, split=split,
                                                        adapters=adapters), force=ev.force)


def _say(msg: str) -> None:
    from rich.console import Console

    Console(stderr=True).print(f"[bold cyan]eval[/] {msg}", highlight=False)


__all__ = ["EvalConfig", "Evaluation", "baseline_models", "evaluate", "finalists", "measure_model", "train_baselines"]
