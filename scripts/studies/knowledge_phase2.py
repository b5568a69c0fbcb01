"""The knowledge study's phase 2 (scripts/studies/knowledge_study.py): the methods at the chosen epochs, one run a
method and seed, each fitting one sitting on the slowest CPU.

WORK/p2-e<E>-s<S>-<method> for each seed and method:
  - moe: the experts of --domains at E epochs and seed S (the first seed's start from phase 1's run at E where it is
    still on disk), then `mfgguf eval --baselines none`: the MoE (ridge, top-1, f16) and the base scored;
  - flop, lora, lora-domain: nothing trained but that baseline, `mfgguf eval --budget-flops SHARD:FLOPS,...
    --baselines <method>` (eval/baselines/budgeted.py) at the FLOPs the MoE's experts spend (each shard's tokens x E,
    rounded up to whole steps, x an expert step's FLOPs a token: mfgguf/flops.py), known before any expert trains.
Every model is scored on the questions about the training documents (train-test.txt) and the test documents
(test.txt), test perplexity, and HellaSwag with --hellaswag. A line keeps each model's figures and each benchmark's
per-task verdicts (ranges of task ids, a string of 0/1), so the summary pairs any two models of one seed across runs:
each method against the base (the moe run's) and the MoE against each method, over the same tasks.
"""

from __future__ import annotations

import json
from pathlib import Path

METHODS = ("moe", "flop", "lora", "lora-domain")
SETS = ("questions-train-test", "questions-test", "hellaswag")  # eval's benchmark names, what phase 2 scores


# ---- the cost of a run -------------------------------------------------------------------------------------


def phase2_cost(a, sp, sz: dict, flops: float, train_s: float, method: str, consts: dict) -> float:
    """Seconds of one phase-2 run on a CPU of speeds `sp`: the template made again, the method's training (`train_s`:
    the MoE's experts; a baseline: `flops` at the training rate, each LR of its grid), and scoring: each model
    assembled, its test perplexity, both question sets and HellaSwag. The moe run also scores the base, the merged
    trunk, one oracle a domain (its own domain's test text), and the MoE on validation (its router's choice)."""
    from mfgguf.eval.baselines.imported import GRID

    cap = lambda toks: sum(min(a.max_tokens, t) for t in toks.values())  # noqa: E731
    ppl = sp.model_s + cap(sz["test"]) / sp.score_tokens_s
    tasks = (sz["questions"]["train-test"] + sz["questions"]["test"]) / 2 + (a.hellaswag_tasks if a.hellaswag else 0)
    bench = tasks * sp.hellaswag_s
    if method == "moe":
        oracles = sum(sp.model_s + min(a.max_tokens, t) / sp.score_tokens_s for t in sz["test"].values())
        score = 3 * ppl + 2 * bench + oracles + cap(sz["valid"]) / sp.score_tokens_s
        return consts["TEMPLATE_S"] + train_s + score
    mode, lrs = ("full", a.full_lrs) if method == "flop" else ("lora", a.lora_lrs)
    grid = len(lrs.split(",")) if lrs else len(GRID[mode])
    grid = 0 if method == "lora-domain" and grid == 1 else grid  # one LR given: the per-domain LoRAs train no grid
    runs = grid + (method == "lora-domain")
    procs = grid + len(a.domains) * (method == "lora-domain")
    factor = consts["ROUTED_FACTOR"] if method == "lora-domain" else 1.0
    return consts["TEMPLATE_S"] + runs * flops / sp.flops + procs * consts["PROCESS_S"] + factor * (ppl + bench)


def budget_flops(ids: dict[str, int], tokens: dict[str, int], per_token: float) -> str:
    """--budget-flops: each trained domain's shard with the FLOPs its expert spends on `tokens` of it."""
    return ",".join(f"{ids[d]}:{tokens[d] * per_token:.6e}" for d in ids)


# ---- a run ---------------------------------------------------------------------------------------------------


def read_json(path: Path) -> dict | None:
    return json.loads(path.read_text()) if path.is_file() else None


def eval_command(a, r, run: Path, ids: dict[str, int], tokens: dict[str, int], per_token: float, mfgguf,
                 dry: bool) -> None:
    """The run's `mfgguf eval` (the MoE and the base; or one baseline at the MoE's FLOPs), where its report is missing
    or lacks HellaSwag asked for."""
    rep = read_json(run / "eval" / "report.json")
    if rep is not None and not (a.hellaswag and "hellaswag" not in (rep.get("general") or {})):
        return
    bench = ("--hellaswag", a.hellaswag, "--hellaswag-tasks", a.hellaswag_tasks) if a.hellaswag else ()
    common = ("--max-tokens", a.max_tokens, "--seed", r.seed, *bench)
    if r.method == "moe":
        mfgguf("eval", run, "--routers", "ridge", "--top-k", "1", "--quants", "", "--baselines", "none", *common,
               log=a.work / "study.log", dry=dry)
        return
    lrs = ("--full-lrs", a.full_lrs) if r.method == "flop" and a.full_lrs else \
        ("--lora-lrs", a.lora_lrs) if r.method != "flop" and a.lora_lrs else ()
    mfgguf("eval", run, "--baselines", r.method, "--budget-flops", budget_flops(ids, tokens, per_token), *lrs,
           *common, log=a.work / "study.log", dry=dry)


def pack_ids(ids: list[int]) -> list[list[int]]:
    """Task ids as [first, last] ranges (a question set's are 0..n-1: one range)."""
    out: list[list[int]] = []
    for i in map(int, ids):
        if out and i == out[-1][1] + 1:
            out[-1][1] = i
        else:
            out.append([i, i])
    return out


def unpack_ids(ranges: list[list[int]]) -> list[int]:
    return [i for lo, hi in ranges for i in range(lo, hi + 1)]


def model_figures(rep: dict, label: str, trained: list[str]) -> dict:
    """One model of an eval report: test perplexity (trained domains, the others, each) and every benchmark's accuracy
    with its per-task verdicts."""
    from mfgguf.eval.measure import mixed

    doms = rep["results"][label]["domains"]
    rest = {d: v for d, v in doms.items() if d not in trained}
    out = {"label": label, "ppl_test_trained": mixed({d: doms[d] for d in trained})["ppl"],
           "ppl_test_untrained": mixed(rest)["ppl"] if rest else None, "ppl_test": {d: v["ppl"] for d, v in doms.items()}}
    for name, g in (rep.get("general") or {}).items():
        if label in g["models"]:
            v = g["verdicts"][label]
            out[name] = {"accuracy": g["models"][label]["accuracy"], "tasks": g["tasks"], "data_sha256": g["data_sha256"],
                         "task_ids": pack_ids(v["task_ids"]), "right": "".join(str(int(x)) for x in v["right"])}
    return out


def phase2_row(a, r, run: Path, ids: dict[str, int], common: dict) -> dict:
    """A phase-2 line from the run's eval report: its models (the moe run: "moe" and "base"; a baseline's: its own),
    each with its training FLOPs (and LR), figures and verdicts."""
    from mfgguf.eval.general import BASE_MODELS

    rep, trained = read_json(run / "eval" / "report.json"), list(ids)
    res, flops = rep["results"], rep["flops"]["models"]
    if r.method == "moe":
        labels = {"moe": next(n for n, m in rep["models"].items() if m["kind"] == "moe" and n in res),
                  "base": next(n for n in BASE_MODELS if n in res)}
    else:
        labels = {r.method: next(n for n, m in rep["models"].items() if m.get("baseline") == r.method)}
    plans = {p["key"]: p for p in (rep.get("base_baselines") or {}).get("plans") or []}
    models = {}
    for m, label in labels.items():
        models[m] = {**model_figures(rep, label, trained), "flops": 0.0 if m == "base" else
                     flops["moe (trunk + every expert)" if m == "moe" else label]["flops"],
                     **({"lr": plans[m]["lr"]} if m in plans else {})}
    return {"phase": 2, "run": r.name, "method": r.method, "epochs": r.epochs, "seed": r.seed,
            "trained_domains": trained, "models": models, "wall_s": rep.get("wall_s"), **common,
            "headline": {m: round(v.get("questions-train-test", {}).get("accuracy", float("nan")), 4)
                         for m, v in models.items()}}


# ---- the summary ---------------------------------------------------------------------------------------------


def pair(x: dict, y: dict) -> dict | None:
    """x's accuracy minus y's, paired over their tasks (runtime/choice/paired.py); None where they scored different
    sets (another question file or task draw)."""
    from mfgguf.runtime.choice.paired import paired

    if x.get("data_sha256") != y.get("data_sha256") or x["task_ids"] != y["task_ids"]:
        return None
    rec = lambda v: {"task_ids": unpack_ids(v["task_ids"]), "right": [int(c) for c in v["right"]]}  # noqa: E731
    return {k: v for k, v in paired(rec(x), rec(y)).items() if k in ("points", "low", "high", "mcnemar_p")}


def by_seed(rows: list[dict]) -> tuple[int | None, dict[int, dict[str, dict]]]:
    """(the epochs most phase-2 models ran, {seed: {method: its figures}}) of phase 2's lines, the last of each."""
    p2 = [r for r in rows if r.get("phase") == 2 and "models" in r]
    if not p2:
        return None, {}
    e2 = max({r["epochs"] for r in p2}, key=lambda e: sum(len(r["models"]) for r in p2 if r["epochs"] == e))
    seeds: dict[int, dict[str, dict]] = {}
    for r in p2:
        if r["epochs"] == e2:
            seeds.setdefault(r["seed"], {}).update(r["models"])
    return e2, dict(sorted(seeds.items()))


def summarize_phase2(rows: list[dict], spread, verdict) -> dict | None:
    """{"epochs", "seeds", "methods": {m: {benchmark: {"accuracy", "tasks", "points", "intervals", "verdict",
    "vs_moe"?}, "ppl_test_trained", "ppl_test_untrained"?, "seeds"}}}: each method paired against its seed's base,
    and the MoE against it, over the same tasks, across runs; None without a phase-2 line."""
    e2, seeds = by_seed(rows)
    if e2 is None:
        return None
    methods = {}
    for m in [m for m in (*METHODS, "base") if any(m in v for v in seeds.values())]:
        ss = [s for s, v in seeds.items() if m in v and "base" in v]
        if not ss:
            continue
        vs = [seeds[s][m] for s in ss]
        f = {"seeds": ss, "ppl_test_trained": spread([v["ppl_test_trained"] for v in vs])}
        if all(v.get("ppl_test_untrained") is not None for v in vs):
            f["ppl_test_untrained"] = spread([v["ppl_test_untrained"] for v in vs])
        for b in SETS:
            pairs = [pair(seeds[s][m][b], seeds[s]["base"][b]) if b in seeds[s][m] and b in seeds[s]["base"] else None
                     for s in ss]
            if any(p is None for p in pairs):
                continue
            pts, iv = [p["points"] for p in pairs], [[p["low"], p["high"]] for p in pairs]
            f[b] = {"accuracy": spread([v[b]["accuracy"] for v in vs]), "tasks": vs[0][b]["tasks"],
                    "points": spread(pts), "intervals": iv, "verdict": verdict(pts, iv) if m != "base" else "",
                    "mcnemar_p": [p["mcnemar_p"] for p in pairs]}
            mine = [pair(seeds[s]["moe"][b], seeds[s][m][b]) if b in seeds[s].get("moe", {}) else None for s in ss]
            if m not in ("moe", "base") and all(mine):
                mp, mi = [p["points"] for p in mine], [[p["low"], p["high"]] for p in mine]
                f[b]["vs_moe"] = {"points": spread(mp), "intervals": mi,
                                  "verdict": verdict(mp, mi, "MoE ahead", "MoE behind")}
        methods[m] = f
    return {"epochs": e2, "seeds": list(seeds), "methods": methods}


__all__ = ["METHODS", "SETS", "budget_flops", "eval_command", "pack_ids", "phase2_cost", "phase2_row",
           "summarize_phase2", "unpack_ids"]
