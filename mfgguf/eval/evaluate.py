"""`mfgguf eval RUN`: does assembling independently trained modules, without retraining, work?

Every figure is measured by llama.cpp on a GGUF written by `mfgguf assemble`, on the test split
no module trained on and no choice looked at (every choice -- the MoE's router and top-k, the
oracle's experts, the baselines' LRs and schedules -- reads the validation split; a RUN prepared
before validation existed has one held-out split for both, and the report says so):
  - the assembled MoE for each router method, top-1 and top-2 (at `base_quant`, f16 by default);
  - the trunk alone (anchor only, no experts);
  - oracle routing: each domain's text through a model holding only its best expert;
  - dense baselines trained from scratch with the same code on the union of all shards, budgeted
    in training FLOPs (mfgguf/eval/baselines.py, mfgguf/flops.py): FLOP-matched and wall-clock-matched
    with the MoE's active parameters per token, and optionally FLOP-matched with its total ones;
    on an imported base instead, the base itself trained further on the experts' data: continued
    pretraining (FLOP- and wall-clock-matched) and a peft LoRA (FLOP-matched), each with its LR
    from a small grid (mfgguf/eval/base_baselines.py), and only the experts trained so far;
  - q8_0 and q4_k against f16 of the assembled MoE with the best router.
Plus per-layer routing accuracy (from the PyTorch reference with the same router weights),
llama.cpp prompt/decode tokens/s and peak RSS per model (each model in its own process), and the
held-out loss curves of the trunk and every baseline against tokens and training FLOPs.
Writes report.md, report.json and PNG plots into RUN/eval/ (or `out`).

This file builds the models and runs the comparison; eval/measure.py measures one model (and the
routing), eval/report.py writes the report against its goals (`Goals`), plots.py draws its figures.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from pathlib import Path

from mfgguf.eval.base_baselines import BASE_BASELINES, plan_and_train
from mfgguf.eval.baselines import flops_section, pick_schedule, plan_baselines, train_baseline
from mfgguf.config import SCHEDULES
from mfgguf.errors import MfggufError
from mfgguf.eval.measure import measure, mixed, routing_accuracy
from mfgguf.plots import eval_plots
from mfgguf.eval.report import Goals, curves, goals, recipe, report_markdown
from mfgguf.run import RunDir, link_or_copy, read_module_meta, router_stats_current, update_manifest, write_json, write_text

STATS_ROUTERS = ("ridge", "centroid")  # routers computed from the experts' statistics (uniform, random: controls)


@dataclass(frozen=True)
class EvalConfig:
    routers: tuple[str, ...] = ("ridge", "centroid", "uniform", "random")  # router methods compared
    top_ks: tuple[int, ...] = (1, 2)  # experts per token compared
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


def evaluate(run: Path, out: Path | None = None, cfg: EvalConfig = EvalConfig(), *, force: bool = False,
             target: Goals = Goals()) -> dict:
    """Compare the assembled MoE against the trunk alone, oracle routing and FLOP- and wall-clock-matched dense models.

    Perplexity per domain and on the mixed held-out set, measured by llama.cpp on GGUFs written
    by `mfgguf assemble`; routing accuracy per layer; q8_0/q4_k against f16; tokens/s and peak
    RSS per model. Writes report.md (tables, each goal checked against `target`), report.json (raw
    figures) and PNG plots.
    """
    from mfgguf.converters.assemble import assemble

    rd = RunDir(run)
    info = rd.info()
    n = info["n_experts"]
    trunk = read_module_meta(rd, 0)
    base = trunk.get("source") == "base"
    # on an imported base, the experts trained so far (a held-out domain may have none: the forgetting test)
    ids = [i for i in range(1, n + 1) if not base or rd.module_meta(i).is_file()]
    if not ids:
        raise MfggufError(f"{rd.root} has no trained expert; train one with `mfgguf train-expert {rd.root} --expert 1`")
    subset = ids if len(ids) < n else None
    if subset:
        _say(f"experts {','.join(map(str, ids))} are trained: the MoE holds those")
    metas = {0: trunk, **{i: read_module_meta(rd, i) for i in ids}}
    schedules = _schedules(cfg) if cfg.dense and not base else ()
    if "ridge" in cfg.routers and not router_stats_current(rd, subset) and any(int(metas[i].get("version", 1)) > 1 for i in metas if i):
        from mfgguf.train.experts.pooled import pool_router_stats

        _say("router statistics (mfgguf router-stats)")  # the ridge router needs them; stale or missing here
        pool_router_stats(rd.root, progress=False, experts=subset)
    heldout = rd.heldout_tokens(cfg.max_tokens_per_domain)
    domains = list(heldout)  # domains with a held-out split
    out = Path(out) if out else rd.root / "eval"
    models_dir = out / "models"
    models_dir.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()

    def build(name: str, **kw) -> Path:
        path = models_dir / f"{name}.gguf"
        if force or not path.is_file() or path.stat().st_mtime < rd.manifest.stat().st_mtime:
            _say(f"assemble {name}")
            assemble(rd.root, path, force=True, progress=False, **{"experts": subset, **kw})
        return path

    models: dict[str, dict] = {}  # name -> {"path", "domains" (evaluated), "kind"}
    for router in cfg.routers:
        for k in cfg.top_ks:
            if k > n:
                continue
            models[f"moe {router} top-{k}"] = {"path": build(f"moe-{router}-top{k}-{cfg.base_quant}", quant=cfg.base_quant,
                                                              router=router, top_k=k),
                                                "kind": "moe", "router": router, "top_k": k}
    models["trunk alone"] = {"path": build(f"trunk-{cfg.base_quant}", quant=cfg.base_quant, experts=[]), "kind": "trunk"}
    trained = _trained_trunk_run(rd, out)  # after `mfgguf sync` the trunk alone is the merged one
    if trained is not None:
        path = models_dir / f"trunk-trained-{cfg.base_quant}.gguf"
        if force or not path.is_file():
            assemble(trained.root, path, force=True, progress=False, quant=cfg.base_quant, experts=[])
        models["trunk as trained (before sync)"] = {"path": path, "kind": "trunk"}
    best_expert = _best_expert_per_domain(metas, domains)
    # complementing experts (train-expert --complement): the oracle is [seed, expert] as trained, top-2 of 2
    oracle = {"router": "learned", "top_k": 2} if metas.get(1, {}).get("complement") else {}
    for d, e in best_expert.items():
        models[f"oracle {d}"] = {"path": build(f"oracle-{d}-{cfg.base_quant}", quant=cfg.base_quant, experts=[e], **oracle),
                                 "kind": "oracle", "domains": [d], "expert": e}
    plans = plan_baselines(metas, cfg.baselines) if cfg.dense and not base else []
    base_plans, base_grid = [], {}
    if cfg.dense and base:  # the practitioner's alternatives: the base itself trained further (eval/base_baselines.py)
        _say("the trunk is an imported base: its baselines are the base trained further on the experts' data"
             " (continued pretraining, LoRA), not dense models from scratch")
        which = tuple(k for k in cfg.baselines if k in BASE_BASELINES) if cfg.baselines is not None else None
        base_plans, base_grid = plan_and_train(rd, metas, out, which, force)
        for p in base_plans:
            path = models_dir / f"base-{p.key}-{cfg.base_quant}.gguf"
            if force or not path.is_file() or path.stat().st_mtime < RunDir(p.run).module_file(0).stat().st_mtime:
                assemble(p.run, path, quant=cfg.base_quant, experts=[], force=True, progress=False)
            models[p.label] = {"path": path, "kind": "dense", "baseline": p.key, "mode": p.mode, "tokens": p.tokens,
                               "lr": p.lr}
    dense_metas, dense_schedules = {}, {}
    for b in plans:
        runs = {s: train_baseline(rd, metas[0], b, out, force, schedule=s) for s in schedules}
        chosen, dense_metas[b.label] = pick_schedule({s: read_module_meta(d, 0) for s, d in runs.items()})
        dense = runs[chosen]
        dense_schedules[b.label] = {"chosen": chosen, "heldout_loss": {s: read_module_meta(d, 0)["heldout_loss_mean"]
                                                                      for s, d in runs.items()}}
        path = models_dir / f"{dense.root.name}-{cfg.base_quant}.gguf"  # dense-<key>[-<schedule>]: the one kept
        if force or not path.is_file() or path.stat().st_mtime < dense.module_file(0).stat().st_mtime:
            assemble(dense.root, path, quant=cfg.base_quant, experts=[], force=True, progress=False)
        models[b.label] = {"path": path, "kind": "dense", "baseline": b.key, "anchor_ff": b.anchor_ff,
                           "tokens": dense_metas[b.label]["tokens_seen"], "schedule": chosen}

    results = {}
    for name, m in models.items():
        _say(f"measure {name}")
        results[name] = _measure(m["path"], rd, m.get("domains", domains), cfg)

    # the one choice made among the assembled models (which router and top-k is "the MoE") is made on validation
    moe_names = [k for k, m in models.items() if m["kind"] == "moe"]
    validation = {}
    for k in moe_names:
        _say(f"measure {k} on validation")
        validation[k] = _measure(models[k]["path"], rd, domains, cfg, split="validation")
    best = min(moe_names, key=lambda k: validation[k]["overall"]["ppl"])
    best_router, best_k = models[best]["router"], models[best]["top_k"]
    quant_rows = {cfg.base_quant: results[best]}
    for q in cfg.quants:
        p = build(f"moe-{best_router}-top{best_k}-{q}", quant=q, router=best_router, top_k=best_k)
        _say(f"measure {best} {q}")
        quant_rows[q] = _measure(p, rd, domains, cfg)
        models[f"{best} {q}"] = {"path": p, "kind": "quant"}
        results[f"{best} {q}"] = quant_rows[q]

    _say("routing accuracy")
    routing = {r: routing_accuracy(rd, domains, heldout, build(f"moe-{r}-top1-{cfg.base_quant}", quant=cfg.base_quant,
                                                                 router=r, top_k=1))
               for r in cfg.routers}

    oracle_mixed = mixed({d: results[f"oracle {d}"]["domains"][d] for d in domains})
    stats_moe = [k for k in moe_names if models[k]["router"] in STATS_ROUTERS]
    best_stats = min(stats_moe, key=lambda k: validation[k]["overall"]["ppl"]) if stats_moe else None
    report = {
        "run": str(rd.root),
        "config": asdict(cfg),
        "domains": domains,
        "models": {k: {**{kk: vv for kk, vv in m.items() if kk != "path"}, "file": m["path"].name,
                       "bytes": m["path"].stat().st_size} for k, m in models.items()},
        "results": results,
        "splits": {**rd.split_roles(), "chosen_on_validation": ["best router and top-k", "oracle experts",
                                                                "baseline LRs and schedules", "training curves"]},
        "validation": {k: v["overall"] for k, v in validation.items()},
        "oracle": {"experts": best_expert, "mixed": oracle_mixed},
        "recipe": recipe(metas),
        "best": best,
        "best_stats_router": best_stats,
        "quant": {q: r["overall"]["ppl"] for q, r in quant_rows.items()},
        "routing": routing,
        "goals": goals(results, best, best_stats, oracle_mixed, quant_rows, cfg.base_quant, cfg.quants, domains,
                       plans + base_plans),
        "flops": flops_section(metas, dense_metas, plans, base_plans),
        "base_baselines": {"grid": base_grid, "plans": [{**asdict(p), "run": str(p.run)} for p in base_plans],
                           "trained_domains": sorted({d for i, m in metas.items() if i for d in m.get("shard_domains") or []})}
        if base else None,
        "dense_schedules": dense_schedules,
        "curves": curves(metas[0], dense_metas),
        "wall_s": round(time.perf_counter() - t_start, 1),
    }
    write_json(out / "report.json", report)
    eval_plots(report, out)
    write_text(out / "report.md", report_markdown(report, target))
    return report


# ---- models ------------------------------------------------------------------------------------


def _schedules(cfg: EvalConfig) -> tuple[str, ...]:
    bad = [s for s in cfg.dense_schedules if s not in SCHEDULES]
    if bad or not cfg.dense_schedules:
        raise MfggufError(f"bad dense schedules {','.join(cfg.dense_schedules)!r}; choose from {', '.join(SCHEDULES)}"
                          " (comma-separated)")
    return tuple(dict.fromkeys(cfg.dense_schedules))


def _best_expert_per_domain(metas: dict, domains: list[str]) -> dict[str, int]:
    """The oracle's choice: for each domain the expert with the lowest held-out loss on it."""
    best = {}
    for d in domains:
        losses = {i: m["heldout_loss"][d] for i, m in metas.items() if i > 0 and d in m.get("heldout_loss", {})}
        if not losses:
            raise MfggufError(f"no expert recorded a held-out loss on domain {d!r}; retrain the experts with this mfgguf")
        best[d] = min(losses, key=losses.get)
    return best


def _trained_trunk_run(rd: RunDir, out: Path) -> RunDir | None:
    """A RUN view (out/trained-trunk) whose trunk is the one `train-trunk` wrote, before the first sync; None if never synced."""
    before = rd.rounds / "sync_01" / "before"
    if not (before / "trunk.safetensors").is_file():
        return None
    view = RunDir(out / "trained-trunk")
    view.modules.mkdir(parents=True, exist_ok=True)
    rd.copy_vocab_to(view)  # an imported base's vocabulary lives in base/, not tokenizer.json
    for name in ("trunk.safetensors", "trunk.json"):
        dst = view.modules / name
        dst.unlink(missing_ok=True)
        link_or_copy(before / name, dst)
    update_manifest(view, 0, read_module_meta(view, 0))
    return view


def _measure(path: Path, rd: RunDir, domains: list[str], cfg: EvalConfig, split: str = "test") -> dict:
    return measure(path, rd, domains, max_tokens=cfg.max_tokens_per_domain, ctx=cfg.ctx,
                   decode_tokens=cfg.decode_tokens if split == "test" else 0, split=split)


def _say(msg: str) -> None:
    from rich.console import Console

    Console(stderr=True).print(f"[bold cyan]eval[/] {msg}", highlight=False)


__all__ = ["EvalConfig", "evaluate"]
