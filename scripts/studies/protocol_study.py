"""The protocol study on an imported base: the MoE recipe against what a practitioner would run instead, at equal
training FLOPs, at several data sizes and seeds, on one test split (docs/studies/protocol.md, "The protocol behind every
comparison").

For each size T (training tokens a trained domain) and seed S, one RUN under OUT (OUT/t<T>-s<S>):
  1. OUT/template, made once: `import-base` and `prepare study` (label partition, one shard a domain, prepare's
     own seed fixed). Every RUN is a hard-linked copy of it (stages replace files, never write into them), so the
     shards, the validation split and the test split are the same files at every size and seed: the seed varies
     training only, never the data;
  2. the experts of --domains, each `train-expert --tokens T --seed S` with the recipe (--expert-ff at import,
     --lr, --shared, --rounds), `mfgguf sync` after each round; the held-out domain sits out of all training;
  3. `mfgguf eval --seed S`: the baselines trained from the same base on the same shards with the experts' FLOPs
     (their LR grids, like the choice of the MoE's top-k, read validation), every model scored once on test;
  4. one JSON line appended to OUT/study.jsonl, with the CPU of every sitting that worked on the RUN
     (RUN/machines.json: a RUN resumed on another machine has walls of two machines).
A (T, S) already in study.jsonl is not run again and each stage is skipped where its output exists (train-expert
and eval resume their own partial work), so the study can stop and resume across sittings. The summary (alone with
--summary-only) reads study.jsonl only: OUT/study.md (per size: mean and min-max over seeds per method, the MoE's
ratio to each, "ahead" only where the margin exceeds the seeds' spread; the crossover size per baseline) and
OUT/study.png (mixed test perplexity on the trained domains against tokens a domain and against training FLOPs,
one line per method).

    python scripts/studies/protocol_study.py --out protocol-study --tokens 65536,262144,1048576 --seeds 1,2
    python scripts/studies/protocol_study.py --out protocol-study --dry-run        # the commands and each run's cost
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

STUDY_DOMAINS = ("c", "cpp", "english", "man", "python")  # mfgguf/data/study.py's; label shards come in this order
IMPORTED_BASELINES = "flop,lora,lora-domain,wallclock"  # eval's imported-base set (eval/baselines/imported.py)
MOES = ("moe top-1", "moe top-2")
# the MoE a method is compared with: at top-1 (the dense model's active FFN, the headline) and at any top-k; each the
# variant (seed gate, top-k) validation chose, seed by seed; (its row's key, the summary's suffix)
HEADS = {"moe@1": ("moe_chosen_top1", "_top1"), "moe": ("moe_chosen", "")}
LORA_RANK = 16  # eval's LoRA baselines' rank (eval/baselines/imported.py)
NAMES = {"moe@1": "MoE top-1 (gate chosen on validation)", "moe": "MoE (top-k and gate chosen on validation)",
         "moe top-1": "MoE top-1", "moe top-2": "MoE top-2",
         "flop": "continued pretraining, FLOP-matched", "wallclock": "continued pretraining, wall-clock-matched",
         "lora": "one LoRA r16 on every domain, FLOP-matched", "lora-domain": "a LoRA per domain, the right adapter",
         "base": "the base"}
# The cost model of --dry-run, from the 2-core machine of docs/studies/protocol.md: an expert step with attention copies
# 697 MFLOP a token at about 510 tokens/s, continued pretraining 834 at about 464, a LoRA 599 at about 507, so
# about 3.5e11 FLOP/s; each training process about 13 s besides its steps; a sync about 16 s, the last one about
# 120 s (it recomputes the router statistics); eval's assembling and scoring as the first run measured it at
# --max-tokens 16384 (74 minutes with six gated MoEs, each about 6 minutes on test and validation), scaled to 32768;
# a gated MoE now costs its validation pass alone (test scores the gate validation chose, in place of the plain MoE).
RATE, PROCESS_S, SYNC_S, LAST_SYNC_S, MEASURE_S, MOE_MEASURE_S = 3.5e11, 13.0, 16.0, 120.0, 4560.0, 360.0
# HellaSwag: a task of one f16 SmolLM2 model on 2 cores (llama-perplexity); the per-domain LoRAs about 3.2x that
# (each context scored under every adapter first, through llama-cpp-python); a model a baseline, the base and the
# two MoEs test scores
HELLASWAG_TASK_S, ROUTED_FACTOR = 0.17, 3.2


def mfgguf(*args, log: Path, dry: bool = False) -> None:
    """One CLI verb in its own process, output appended to `log` (printed only, with --dry-run); stops on failure
    (the message names the study script that ran it: scripts/studies/experts_count.py runs its verbs through this too)."""
    line = "mfgguf " + shlex.join(map(str, args))
    if dry:
        print(line)
        return
    with open(log, "a") as f:
        f.write(f"$ {line}\n")
        f.flush()
        t0 = time.perf_counter()
        rc = subprocess.call([sys.executable, "-m", "mfgguf", *map(str, args)], stdout=f, stderr=subprocess.STDOUT,
                             cwd=ROOT)
        f.write(f"# rc={rc} in {time.perf_counter() - t0:.1f} s\n")
    if rc:
        sys.exit(f"{Path(sys.argv[0]).stem}: `mfgguf {args[0]}` failed (exit {rc}); see {log}")


def read_json(path: Path) -> dict | None:
    """A RUN's record (or a report), read under the current names where an earlier mfgguf wrote it (run/legacy.py)."""
    from mfgguf.run.legacy import OLD_RUN_KEYS, renamed

    return renamed(json.loads(path.read_text()), OLD_RUN_KEYS if path.name == "run.json" else None) \
        if path.is_file() else None


# ---- the runs --------------------------------------------------------------------------------------------


def make_template(a, out: Path, log: Path) -> Path:
    """OUT/template: the base imported and the study corpus prepared into it, once for every size and seed."""
    t = out / "template"
    if not (t / "modules" / "trunk.json").is_file():
        mfgguf("import-base", a.base, "--out", t, "--expert-ff", a.expert_ff, "--force", log=log, dry=a.dry_run)
    if not (t / "run.json").is_file():
        # enough characters that the largest size's shards hold it once (with the tokenizer's few characters a
        # token on this corpus); a shorter shard is recorded and warned about, not refused
        chars = a.max_chars_per_domain or math.ceil(4 * max(a.tokens) / (1 - a.test_frac - a.valid_frac))
        mfgguf("prepare", "study", "--out", t, "--experts", len(STUDY_DOMAINS), "--partition", "label",
               "--max-chars-per-domain", chars, "--test-frac", a.test_frac, "--valid-frac", a.valid_frac,
               "--seed", 0, "--no-progress", log=log, dry=a.dry_run)
    return t


def recipe(a) -> dict:
    """What every row of one study shares: a study.jsonl resumed with another recipe would mix two studies."""
    return {"base": str(a.base), "expert_ff": a.expert_ff, "lr": a.lr, "shared": a.shared,
            "shared_lr_scale": a.shared_lr_scale, "rounds": a.rounds, "domains": a.domains, "held_out": a.held_out,
            "baselines": a.baselines, "eval_max_tokens": a.max_tokens, "eval_tokens": a.eval_tokens,
            **({"seed_gates": a.seed_gates} if a.seed_gates else {})}


def check_resumable(a, template: Path, rows: list[dict]) -> None:
    """One line and stop where OUT holds a template or rows made with other settings than these."""
    meta, info = read_json(template / "modules" / "trunk.json"), read_json(template / "run.json")
    if meta is not None and int(meta["config"]["expert_ff"]) != a.expert_ff:
        sys.exit(f"protocol_study: {template} was imported with --expert-ff {meta['config']['expert_ff']}, not"
                 f" {a.expert_ff}; use another --out")
    if info is not None and (info.get("test_frac"), info.get("valid_frac")) != (a.test_frac, a.valid_frac):
        sys.exit(f"protocol_study: {template} was prepared with other --test-frac/--valid-frac; use another --out")
    other = next((r for r in rows if r.get("recipe") != recipe(a)), None)
    if other is not None:
        sys.exit(f"protocol_study: {a.out / 'study.jsonl'} holds a run of another recipe ({other['run']}:"
                 f" {json.dumps(other.get('recipe'))}); use another --out")


def short_shards(template: Path, ids: dict[str, int], tokens: int) -> list[str]:
    """The trained domains whose shard holds fewer than `tokens`: their experts see some tokens more than once."""
    info = read_json(template / "run.json")
    held = {int(s["id"]): int(s["tokens"]) for s in (info or {}).get("shards", [])}
    return [f"{d} ({held[i]:,})" for d, i in ids.items() if i in held and held[i] < tokens]


def check_splits(template: Path, max_tokens: int) -> None:
    """Stop before anything trains where eval would refuse the runs: a domain's test or validation text shorter than
    one of its perplexity windows (eval's own check, on the template every run copies)."""
    if not (template / "run.json").is_file():  # a dry run before the template exists
        return
    from mfgguf.errors import MfggufError
    from mfgguf.eval.evaluate import check_windows
    from mfgguf.run import RunDir

    try:
        check_windows(RunDir(template), cap=max_tokens)
    except MfggufError as e:
        sys.exit(f"protocol_study: {template}: {e}; with --max-chars-per-domain in a new --out")


def shard_ids(template: Path, domains: list[str]) -> dict[str, int]:
    """{domain: its expert}: from the template's run.json once prepared, else the label partition's order."""
    info = read_json(template / "run.json")
    if info is None:
        return {d: STUDY_DOMAINS.index(d) + 1 for d in domains}
    own = {next(iter(s["domains"])): int(s["id"]) for s in info["shards"] if len(s["domains"]) == 1}
    missing = [d for d in domains if d not in own]
    if missing:
        sys.exit(f"protocol_study: {template} has no shard of domain {missing[0]} alone; prepare it again")
    return {d: own[d] for d in domains}


def copy_template(template: Path, run: Path) -> None:
    from mfgguf.run import link_or_copy

    if run.is_dir():
        return
    tmp = run.with_name(run.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    # a lock file is opened to append, the one file a stage does not replace: each RUN gets its own
    shutil.copytree(template, tmp, copy_function=link_or_copy, ignore=shutil.ignore_patterns("*.lock"))
    tmp.rename(run)


def note_machine(run: Path) -> None:
    """Add this CPU to RUN/machines.json where it is new: a run whose sittings ran on different machines says so, and
    its walls (the MoE's and the baselines', the wall-clock-matched budget) are then not of one machine."""
    from mfgguf.machine import cpu
    from mfgguf.run.files import write_json

    seen, here = read_json(run / "machines.json") or [], cpu()
    if here not in seen:
        write_json(run / "machines.json", [*seen, here])


def machines_line(rows: list[dict]) -> str:
    """Which CPUs measured these rows, and every row whose stages ran on more than one."""
    cpus = {f"{m['model']} ({', '.join(m['flags'])}; {m['cores']} cores)" for r in rows for m in r.get("machines", [])}
    mixed = [r["run"] for r in rows if len(r.get("machines", [])) > 1]
    return ("CPU: " + ("; ".join(sorted(cpus)) if cpus else "not recorded") + "."
            + (f" {', '.join(mixed)} ran on more than one: their walls mix machines." if mixed else ""))


def train_and_eval(a, run: Path, ids: list[int], tokens: int, seed: int, log: Path) -> None:
    """The experts round by round with a sync after each, then eval (not with --train-only): each step only where its
    output is missing."""
    dry = a.dry_run
    for k in range(1, a.rounds + 1):
        for i in ids:
            meta = read_json(run / "modules" / f"expert_{i:03d}.json")
            if meta is None or int(meta.get("round", 1)) < k:
                mfgguf("train-expert", run, "--expert", i, "--tokens", tokens, "--eval-tokens", a.eval_tokens,
                       "--lr", a.lr, "--shared", a.shared, "--shared-lr-scale", a.shared_lr_scale, "--rounds", a.rounds,
                       "--seed", seed, "--no-progress",
                       log=log, dry=dry)
        trunk = read_json(run / "modules" / "trunk.json") or {}
        if a.shared != "none" and int(trunk.get("syncs") or 0) < k:
            mfgguf("sync", run, "--experts", ",".join(map(str, ids)), "--no-progress", log=log, dry=dry)
    if not a.train_only and needs_eval(a, run):
        gates = ("--seed-gates", a.seed_gates) if a.seed_gates else ()
        grids = [x for opt, v in (("--full-lrs", a.full_lrs), ("--lora-lrs", a.lora_lrs)) if v for x in (opt, v)]
        bench = ("--hellaswag", a.hellaswag, "--hellaswag-tasks", a.hellaswag_tasks) if a.hellaswag else ()
        mfgguf("eval", run, "--routers", "ridge", "--top-k", "1,2", *gates, "--quants", "", "--max-tokens", a.max_tokens,
               "--baselines", a.baselines, "--seed", seed, *grids, *bench, log=log, dry=dry)


def needs_eval(a, run: Path) -> bool:
    """No report yet, or one without the HellaSwag scores asked for (eval then scores them alone: every other
    measurement and baseline is kept in the RUN and read back)."""
    rep = read_json(run / "eval" / "report.json")
    return rep is None or bool(a.hellaswag) and "hellaswag" not in (rep.get("general") or {})


def prune(run: Path) -> None:
    """A finished RUN's GGUFs and the baselines' trained weights (under eval/); its report and records stay."""
    for f in [*(run / "eval").rglob("*.gguf"), *(run / "eval").rglob("*.safetensors")]:
        f.unlink()


def split_digest(run: Path) -> str:
    """sha256 over the test split's files, so the summary can check every row scored the same test split."""
    from mfgguf.run import RunDir, sha256_file

    h = hashlib.sha256()
    for f in sorted(RunDir(run).test_dir.iterdir()):
        h.update(f"{f.name}:{sha256_file(f)}\n".encode())
    return h.hexdigest()


def training_wall(meta: dict) -> tuple[float, bool]:
    """A baseline training's wall seconds, and whether they are estimated: a training killed and resumed before its
    record counted the earlier processes (`resumed_train_s`) recorded only its last process's wall, so the tokens the
    earlier ones trained are priced at the last one's speed."""
    start = float(meta.get("startup_s") or 0.0)  # its process's imports, before the training's clock
    if not meta.get("resumed_from_step") or "resumed_train_s" in meta:
        return float(meta["wall_s"]) + start, False
    # tokens_per_s is the last process's tokens over its train_s: every token at that speed, less its own seconds
    return start + float(meta["wall_s"]) + int(meta["tokens_seen"]) / float(meta["tokens_per_s"]) - float(meta["train_s"]), True


def result_row(a, run: Path, tokens: int, seed: int, ids: dict[str, int]) -> dict:
    """study.jsonl's line for one finished RUN: per method its test figures, training FLOPs and wall seconds."""
    from mfgguf.eval.baselines.imported import expert_walls
    from mfgguf.eval.measure import mixed
    from mfgguf.eval.spread import spreads
    from mfgguf.run import RunDir, read_module, read_module_meta

    rep = read_json(run / "eval" / "report.json")
    models, flops, trained = rep["models"], rep["flops"]["models"], list(ids)

    def figures(label: str) -> dict:
        doms = rep["results"][label]["domains"]
        return {"label": label, "ppl_trained": mixed({d: doms[d] for d in trained})["ppl"], "ppl_held_out": doms[a.held_out]["ppl"],
                "ppl_all": rep["results"][label]["overall"]["ppl"], "domains": {d: v["ppl"] for d, v in doms.items()}}

    rd = RunDir(run)
    walls, syncs = expert_walls(rd, {i: read_module(rd, i) for i in ids.values()})
    methods, chosen, top1 = {}, None, {}
    for name, m in models.items():
        # a gate validation turned down has no test figures (eval scores the chosen one of each top-k)
        if m["kind"] == "moe" and f"moe top-{m['top_k']}" in MOES and name in rep["results"]:
            key = f"moe top-{m['top_k']}" + (f" seed-gate {m['seed_gate']:g}" if m.get("seed_gate") is not None else "")
            methods[key] = {**figures(name), "flops": flops["moe (trunk + every expert)"]["flops"],
                            "wall_s": sum(walls.values()) + syncs, "critical_path_s": max(walls.values()) + syncs}
            chosen = key if name == rep["best"] else chosen
            if m["top_k"] == 1 and name in rep.get("validation", {}):
                top1[key] = rep["validation"][name]["ppl"]
    plans = {p["key"]: p for p in (rep.get("base_baselines") or {}).get("plans") or []}
    for name, m in models.items():
        if m["kind"] == "dense" and m["baseline"] in plans:
            p = plans[m["baseline"]]
            runs = [Path(x["run"]) for x in p.get("adapters") or []] or [Path(p["run"])]
            bw = [training_wall(read_module_meta(RunDir(r), 0, weights_kept=False)) for r in runs]
            methods[m["baseline"]] = {**figures(name), "flops": flops[name]["flops"], "lr": p["lr"],
                                      "wall_s": sum(w for w, _ in bw), "wall_estimated": any(e for _, e in bw)}
    base = "trunk as trained (before sync)" if "trunk as trained (before sync)" in rep["results"] else "trunk alone"
    methods["base"] = {**figures(base), "flops": 0.0, "wall_s": 0.0}  # its pretraining counts for nobody
    res = rep["results"]
    others = {k: res[v["label"]]["domains"] for k, v in methods.items() if not k.startswith("moe ")}
    others["oracle"] = {d: res[f"oracle {d}"]["domains"][d] for d in trained if f"oracle {d}" in res}
    doc_spread = spreads(res[rep["best"]]["domains"], others, trained)  # the trained mix, over resampled test documents
    cfg = read_json(run / "modules" / "trunk.json")["config"]
    methods = {m: {**v, **serving(cfg, m, len(ids)), **general_figures(rep, v["label"])} for m, v in methods.items()}
    info = read_json(run / "run.json")
    shard_tokens = {d: next(s["tokens"] for s in info["shards"] if int(s["id"]) == i) for d, i in ids.items()}
    return {"tokens_per_domain": tokens, "seed": seed, "run": run.name, "trained_domains": trained,
            "held_out": a.held_out, "moe_chosen": chosen, "moe_chosen_top1": min(top1, key=top1.get, default=None),
            "methods": methods, "goals": rep["goals"], "test_spread_trained": doc_spread,
            "shard_tokens": shard_tokens, "test_tokens": {d: v["tokens"] for d, v in info["test"].items()},
            "test_split_sha256": split_digest(run), "eval_wall_s": rep.get("wall_s"), "recipe": recipe(a),
            "machines": read_json(run / "machines.json") or [],
            "lr_grid": {mode: g["validation_loss_trained_domains"] for mode, g in (rep.get("base_baselines") or {}).get("grid", {}).items()}}


def general_figures(rep: dict, label: str) -> dict:
    """{benchmark: {"accuracy", "tasks", "points" (- the base, paired), "low", "high", "mcnemar_p"}} of eval's model
    `label` (eval/general.py); the base's own has points 0."""
    out = {}
    for name, g in (rep.get("general") or {}).items():
        if label in g["models"]:
            p = g["paired"].get(label) or {"points": 0.0, "low": 0.0, "high": 0.0, "mcnemar_p": 1.0}
            out[name] = {"accuracy": g["models"][label]["accuracy"], "tasks": g["tasks"],
                         **{k: p[k] for k in ("points", "low", "high", "mcnemar_p")}}
    return out


def serving(cfg: dict, method: str, n: int) -> dict:
    """What a method costs to serve, by mfgguf/flops.py: forward MFLOP a token and non-embedding parameters. An MoE
    runs its top-k of n experts (+ the seed's slot when gated) and its router; the one LoRA is merged into the base;
    the per-domain LoRAs are n adapters of rank 16, the request's applied unmerged (as llama.cpp serves them)."""
    from mfgguf.flops import served_flops, served_params

    if method.startswith("moe top-"):
        k, routed = int(method.split()[1][4:]), n + ("seed-gate" in method)
        f, p = served_flops(cfg, ffns=k, routed=routed), served_params(cfg, ffns=routed, routed=routed)
    elif method == "lora-domain":
        f, p = served_flops(cfg, rank=LORA_RANK), served_params(cfg, rank=LORA_RANK, adapters=n)
    else:  # the base, continued pretraining, the one LoRA merged
        f, p = served_flops(cfg), served_params(cfg)
    return {"serve_mflop_per_token": f / 1e6, "params": p}


# ---- the cost of a run, for --dry-run -----------------------------------------------------------------------


def plan_config(a, template: Path):
    """The trunk's ModelConfig: the template's once imported, else what import-base would make of the base; None
    (with why) where neither can be read here."""
    from mfgguf.config import ModelConfig

    meta = read_json(template / "modules" / "trunk.json")
    if meta is not None:
        return ModelConfig.from_dict(meta["config"]), ""
    try:
        from mfgguf.base.importer import open_base, trunk_config

        return trunk_config(open_base(a.base).shape, expert_ff=a.expert_ff), ""
    except Exception as e:  # noqa: BLE001  (an estimate must not stop a dry run)
        return None, str(e).splitlines()[0] if str(e) else type(e).__name__


def estimate(cfg, tokens: int, n: int, rounds: int, shared: str, baselines: list[str], max_tokens: int,
             rate: float = RATE, gated_moes: int = 0, grid_points: tuple[int | None, int | None] = (None, None),
             hellaswag_tasks: int = 0) -> dict:
    """Training FLOPs of one RUN (the MoE, then every baseline training eval runs, its `grid_points` LRs of continued
    pretraining and of the LoRA included, None for eval's default grid) and its seconds at `rate` FLOP/s with the fixed costs above."""
    from mfgguf.config import shared_tensor_names
    from mfgguf.eval.baselines.imported import GRID
    from mfgguf.flops import expert_step_flops

    grid_points = tuple(g or len(GRID[mode]) for g, mode in zip(grid_points, ("full", "lora")))  # None: eval's grid

    per_token = expert_step_flops(cfg, shared_tensor_names(cfg, shared)).total
    moe = n * tokens * per_token
    expert_s = tokens * per_token / rate + rounds * PROCESS_S
    sync_s = (rounds - 1) * SYNC_S + LAST_SYNC_S if shared != "none" else 0.0
    critical = expert_s + sync_s
    grid, procs = 0.0, 0
    if {"flop", "wallclock"} & set(baselines):
        g = grid_points[0]  # each LR of the full grid trains for the experts' whole FLOPs
        grid, procs = grid + g * moe, procs + g
    if {"lora", "lora-domain"} & set(baselines):
        g = grid_points[1]
        grid, procs = grid + g * moe, procs + g
    if "lora-domain" in baselines:
        grid, procs = grid + moe, procs + n  # a LoRA per shard, each for its expert's FLOPs
    if "wallclock" in baselines:
        grid, procs = grid + critical * rate, procs + 1
    train_s = n * expert_s + sync_s + grid / rate + procs * PROCESS_S
    models = 3 + len([b for b in baselines if b != "lora-domain"]) + ROUTED_FACTOR * ("lora-domain" in baselines)
    return {"expert_flops_per_token": per_token, "moe_flops": moe, "baseline_flops": grid,
            "hellaswag_s": hellaswag_tasks * HELLASWAG_TASK_S * models,
            "seconds": train_s + (MEASURE_S + gated_moes * MOE_MEASURE_S) * max_tokens / 32768
            + hellaswag_tasks * HELLASWAG_TASK_S * models}


# ---- the summary ------------------------------------------------------------------------------------------


def load_rows(path: Path) -> list[dict]:
    """study.jsonl's rows, the last one of each (tokens, seed)."""
    rows = {}
    for line in path.read_text().splitlines() if path.is_file() else []:
        if line.strip():
            r = json.loads(line)
            rows[(r["tokens_per_domain"], r["seed"])] = r
    return [rows[k] for k in sorted(rows)]


def spread(vals: list[float]) -> dict:
    return {"mean": sum(vals) / len(vals), "min": min(vals), "max": max(vals), "n": len(vals)}


def method_values(r: dict, m: str) -> dict | None:
    return r["methods"].get(r.get(HEADS[m][0])) if m in HEADS else r["methods"].get(m)


def verdict(moe: dict, other: dict) -> str:
    """ahead / behind only where the MoE's margin over the other's mean exceeds the wider of the two seed ranges."""
    if min(moe["n"], other["n"]) < 2:
        return "one seed"
    margin, width = other["mean"] - moe["mean"], max(moe["max"] - moe["min"], other["max"] - other["min"])
    return "ahead" if margin > width else "behind" if -margin > width else "within the spread"


def summarize(rows: list[dict]) -> dict:
    """{"sizes": {tokens: {"seeds", "methods": {m: figures}, "ratios<sfx>": {m: MoE / m}, "verdicts<sfx>": {m: ...}}},
    "crossover<sfx>": {m: tokens or None}}, one <sfx> a head of HEADS (the MoE at top-1, at any top-k)."""
    sizes = {}
    for t in sorted({r["tokens_per_domain"] for r in rows}):
        rs = [r for r in rows if r["tokens_per_domain"] == t]
        gated = sorted({m for r in rs for m in r["methods"] if "seed-gate" in m})  # eval --seed-gates' MoEs
        # a variant (top-k, gate) is a row of its own only where every seed scored it on test: eval scores only the
        # gate validation chose, and a mean over the seeds where a variant won would flatter it
        every = [m for m in (*MOES, *gated) if all(m in r["methods"] for r in rs)]
        names = [*HEADS, *every, *[m for m in NAMES if m not in (*HEADS, *MOES) and any(m in r["methods"] for r in rs)]]
        ms = {}
        for m in names:
            vs = [v for r in rs if (v := method_values(r, m)) is not None]
            if vs:
                ms[m] = {k: spread([v[k] for v in vs]) for k in ("ppl_trained", "ppl_held_out", "flops", "wall_s")}
                ms[m]["served"] = {k: vs[0][k] for k in ("serve_mflop_per_token", "params") if k in vs[0]}
                ms[m]["wall_estimated"] = any(v.get("wall_estimated") for v in vs)
                if all("hellaswag" in v for v in vs):
                    h = [v["hellaswag"] for v in vs]
                    ms[m]["hellaswag"] = {"accuracy": spread([x["accuracy"] for x in h]),
                                          "points": spread([x["points"] for x in h]), "tasks": h[0]["tasks"],
                                          "intervals": [[x["low"], x["high"]] for x in h]}
        others = [m for m in ms if m not in HEADS and m not in MOES and m not in gated]
        sizes[t] = {"seeds": sorted(r["seed"] for r in rs), "methods": ms}
        for head, (_, sfx) in HEADS.items():
            if head not in ms:  # rows from before the top-1 choice was recorded
                continue
            sizes[t]["ratios" + sfx] = {m: spread([method_values(r, head)["ppl_trained"] / r["methods"][m]["ppl_trained"]
                                                   for r in rs if m in r["methods"] and method_values(r, head)])
                                        for m in others}
            sizes[t]["verdicts" + sfx] = {m: verdict(ms[head]["ppl_trained"], ms[m]["ppl_trained"]) for m in others}
    out = {"sizes": sizes}
    for _, sfx in HEADS.values():
        baselines = sorted({m for s in sizes.values() for m in s.get("verdicts" + sfx, {})}, key=list(NAMES).index)
        out["crossover" + sfx] = {m: next((t for t, s in sizes.items() if s.get("verdicts" + sfx, {}).get(m) == "ahead"),
                                          None) for m in baselines}
    return out


def _served(f: dict, key: str, fmt: str) -> str:
    v = f.get("served", {}).get(key)
    return "" if v is None else fmt.format(v)


def _cell(v) -> str:
    return ",".join(map(str, v)) if isinstance(v, list) else str(v)


def min_max(s: dict, fmt: str = "{:.4f}") -> str:
    return f"{fmt.format(s['min'])}-{fmt.format(s['max'])}" if s["n"] > 1 else ""


def markdown(rows: list[dict], summ: dict) -> str:
    digests = {r["test_split_sha256"] for r in rows}
    r0 = rows[0]
    L = ["# Protocol study: the MoE against the practitioner's baselines at equal training FLOPs", "",
         f"Base {r0['recipe']['base']}; recipe {', '.join(f'{k} {_cell(v)}' for k, v in r0['recipe'].items() if k != 'base')}."
         f" Trained domains {', '.join(r0['trained_domains'])}; {r0['held_out']} held out of all training.",
         "Test perplexity by llama.cpp (f16), scored once per final model; every choice (the MoE's top-k, the baselines'"
         " LRs) read validation. Mean over seeds, min-max beside it. \"ahead\"/\"behind\": the MoE against the method,"
         " at top-1 (the headline: the dense model's active FFN) and at the top-k validation chose, each with the seed"
         " gate validation chose, only where the gap between means exceeds the wider of the two seed ranges."
         " Wall s: one machine, every expert and sync in turn (the MoE's critical path with a machine per expert is"
         " in study.jsonl); a baseline's, its chosen training alone (its LR grid's other points not counted); ~ where"
         " a training was killed and resumed before its record counted the earlier processes, its tokens priced at"
         " the last process's speed.",
         "", ("Every row scored the same test split (sha256 " + next(iter(digests))[:16] + ")." if len(digests) == 1
              else f"WARNING: the rows scored {len(digests)} different test splits; they are not comparable.")]
    for t, s in summ["sizes"].items():
        L += ["", f"## {t:,} tokens a domain (seeds {', '.join(map(str, s['seeds']))})", "",
              machines_line([r for r in rows if r["tokens_per_domain"] == t]), "",
              f"| method | test ppl, trained mix | min-max | {r0['held_out']} (held out) | training FLOPs | wall s |"
              " served MFLOP a token | params (non-embedding) | MoE top-1 / method | min-max | MoE top-1 |"
              " MoE any k / method | min-max | MoE any k |",
              "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|---|"]
        for m, f in s["methods"].items():
            p, ratio = f["ppl_trained"], ""
            for _, sfx in HEADS.values():
                rt = s.get("ratios" + sfx, {}).get(m)
                ratio += f" {rt['mean']:.4f} | {min_max(rt)} | {s['verdicts' + sfx][m]} |" if rt else " | | |"
            L.append(f"| {NAMES.get(m, 'MoE ' + m[4:])} | {p['mean']:.4f} | {min_max(p)} | {f['ppl_held_out']['mean']:.3f} |"
                     f" {f['flops']['mean']:.3e} | {'~' * f.get('wall_estimated', False)}{f['wall_s']['mean']:,.0f} |"
                     f" {_served(f, 'serve_mflop_per_token', '{:,.1f}')} | {_served(f, 'params', '{:,}')} |" + ratio)
    L += ["", "## Where the MoE passes each method", "",
          "The smallest size where the MoE's mean is below the method's by more than the seed spread.", ""]
    for head, (_, sfx) in HEADS.items():
        L += [f"{NAMES[head]}:", "", "| method | crossover (tokens a domain) | " + " | ".join(f"{t:,}" for t in summ["sizes"])
              + " |", "|---|---:|" + "---|" * len(summ["sizes"])]
        for m, t in summ["crossover" + sfx].items():
            cells = [s.get("verdicts" + sfx, {}).get(m, "") for s in summ["sizes"].values()]
            L.append(f"| {NAMES[m]} | {'not reached' if t is None else f'{t:,}'} | " + " | ".join(cells) + " |")
        L.append("")
    keys = sorted({k for r in rows for k, v in r["goals"].items() if k.startswith("moe_over_") and isinstance(v, float)})
    if keys:
        L += ["", "## Eval's own ratios (all domains, the held-out one included; the stream on its own tokens)", "",
              "| ratio | " + " | ".join(f"{t:,}" for t in summ["sizes"]) + " |", "|---|" + "---:|" * len(summ["sizes"])]
        for k in keys:
            cells = []
            for t in summ["sizes"]:
                vs = [r["goals"][k] for r in rows if r["tokens_per_domain"] == t and k in r["goals"]]
                cells.append(f"{sum(vs) / len(vs):.4f} ({min(vs):.4f}-{max(vs):.4f})" if vs else "")
            L.append(f"| {k} | " + " | ".join(cells) + " |")
    L += general_markdown(summ)
    L += ["", "![test perplexity against tokens a domain and against training FLOPs](study.png)"]
    return "\n".join(L) + "\n"


def general_markdown(summ: dict) -> list[str]:
    """Each size's HellaSwag table: accuracy and the paired difference to the base, over seeds."""
    L = []
    for t, s in summ["sizes"].items():
        ms = {m: f["hellaswag"] for m, f in s["methods"].items() if "hellaswag" in f}
        if not ms:
            continue
        n = next(iter(ms.values()))["tasks"]
        L += ["", f"## General ability at {t:,} tokens a domain: HellaSwag", "",
              f"{n:,} tasks (llama-perplexity's draw), the same for every model and seed, scored as llama-perplexity"
              " scores them; the difference to the base is paired over the tasks, each seed's 95% interval beside"
              " the mean over seeds.", "",
              "| method | accuracy | min-max | - base, points | min-max | each seed's paired interval |",
              "|---|---:|---:|---:|---:|---|"]
        for m, h in ms.items():
            iv = "; ".join(f"{lo:+.2f} to {hi:+.2f}" for lo, hi in h["intervals"]) if m != "base" else "(the base)"
            acc = {k: 100 * v for k, v in h["accuracy"].items() if k != "n"} | {"n": h["accuracy"]["n"]}
            L.append(f"| {NAMES.get(m, 'MoE ' + m[4:])} | {acc['mean']:.2f}% | {min_max(acc, '{:.2f}')} |"
                     f" {h['points']['mean']:+.2f} | {min_max(h['points'], '{:+.2f}')} | {iv} |")
    return L


def plot(summ: dict, path: Path) -> None:
    """Test perplexity against tokens a domain (left) and against training FLOPs (right): every method, its mean
    over the seeds, bars from the lowest to the highest seed."""
    from mfgguf.plots import pyplot, save_figure

    plt = pyplot()
    fig, (by_tokens, by_flops) = plt.subplots(1, 2, figsize=(12, 4.8), sharey=True)
    sizes = summ["sizes"]
    for m in [m for m in NAMES if m not in ("moe", "moe top-1", "base")]:
        pts = [(t, s["methods"][m]["flops"]["mean"], s["methods"][m]["ppl_trained"]) for t, s in sizes.items()
               if m in s["methods"]]
        if not pts:
            continue
        ys = [p[2]["mean"] for p in pts]
        err = [[y - p[2]["min"] for y, p in zip(ys, pts)], [p[2]["max"] - y for y, p in zip(ys, pts)]]
        style = dict(marker="o" if m.startswith("moe") else "s", capsize=3,
                     linestyle="-" if m.startswith("moe") else "--", label=NAMES[m])
        line = by_tokens.errorbar([p[0] for p in pts], ys, yerr=err, **style)
        by_flops.errorbar([p[1] for p in pts], ys, yerr=err, color=line[0].get_color(), **style)
        if m == "moe@1":
            for t, x, y in zip([p[0] for p in pts], [p[1] for p in pts], ys):
                by_flops.annotate(f"{t:,} tokens a domain", (x, y), textcoords="offset points", xytext=(0, 8),
                                  fontsize=7, ha="center")
    base = [s["methods"]["base"]["ppl_trained"]["mean"] for s in sizes.values() if "base" in s["methods"]]
    for ax in (by_tokens, by_flops):
        if base:
            ax.axhline(base[0], color="gray", lw=0.8, linestyle=":", label=NAMES["base"])
        ax.set_xscale("log")
        ax.margins(x=0.15)  # room for the sizes' labels at both ends
        ax.grid(alpha=0.3)
    by_tokens.set_xticks(sorted(sizes), [f"{t:,}" for t in sorted(sizes)])
    by_tokens.minorticks_off()
    by_tokens.set(xlabel="training tokens a domain", ylabel="test perplexity, trained domains (mixed)",
                  title="mean over seeds, bars: min-max")
    by_flops.set(xlabel="training FLOPs (the same points)")
    by_tokens.legend(fontsize=7)
    fig.tight_layout()
    save_figure(fig, path, plt)


def write_summary(out: Path) -> dict:
    rows = load_rows(out / "study.jsonl")
    if not rows:
        sys.exit(f"protocol_study: {out / 'study.jsonl'} holds no finished run yet")
    summ = summarize(rows)
    (out / "study.md").write_text(markdown(rows, summ))
    plot(summ, out / "study.png")
    return {"rows": len(rows), "table": str(out / "study.md"), "plot": str(out / "study.png"),
            "crossover_top1": summ.get("crossover_top1"), "crossover": summ["crossover"]}


def rerow(a, out: Path, ids: dict[str, int]) -> int:
    """study.jsonl written again, each finished run's line made anew from its eval report and records (a line whose
    report is gone, after --prune, kept as it was); the number of lines made anew."""
    rows, n = load_rows(out / "study.jsonl"), 0
    for i, r in enumerate(rows):
        run = out / r["run"]
        if (run / "eval" / "report.json").is_file():
            if r.get("recipe") != recipe(a):
                sys.exit(f"protocol_study: {r['run']} was run with another recipe than these options give"
                         f" ({json.dumps(r.get('recipe'))}); pass the options it was run with")
            rows[i], n = result_row(a, run, r["tokens_per_domain"], r["seed"], ids), n + 1
    tmp = out / "study.jsonl.tmp"
    tmp.write_text("".join(json.dumps(r) + "\n" for r in rows))
    tmp.replace(out / "study.jsonl")
    return n


# ---- main ----------------------------------------------------------------------------------------------------


def parse(argv=None):
    ints = lambda s: [int(x) for x in s.split(",") if x.strip()]  # noqa: E731
    names = lambda s: [x.strip() for x in s.split(",") if x.strip()]  # noqa: E731
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path("protocol-study"))
    ap.add_argument("--base", default="smollm2", help="any `import-base` source")
    ap.add_argument("--tokens", type=ints, default=[65536, 262144, 1048576], help="training tokens a trained domain")
    ap.add_argument("--seeds", type=ints, default=[1, 2], help="the experts' and the baselines' training seeds")
    ap.add_argument("--expert-ff", type=int, default=768, help="import-base --expert-ff: every expert's width")
    ap.add_argument("--lr", type=float, default=1e-3, help="the experts' peak LR")
    ap.add_argument("--shared", default="attn", help="train-expert --shared (none: FFN-only experts, no sync)")
    ap.add_argument("--shared-lr-scale", type=float, default=0.3)
    ap.add_argument("--rounds", type=int, default=4, help="sync rounds")
    ap.add_argument("--domains", type=names, default=["c", "cpp", "man", "python"], help="the trained domains")
    ap.add_argument("--held-out", default="english", help="the domain no training sees (forgetting)")
    ap.add_argument("--baselines", default=IMPORTED_BASELINES, help="eval --baselines")
    ap.add_argument("--seed-gates", default="", help="eval --seed-gates: the MoE with the base's FFN routable too, at"
                    " these gates (comma-separated; empty: none); the MoE is then the best of all on validation")
    ap.add_argument("--full-lrs", default="", help="eval --full-lrs: continued pretraining's LR grid (empty: eval's"
                    " three); one value spends a later seed or size on the LR an earlier run chose on validation")
    ap.add_argument("--lora-lrs", default="", help="eval --lora-lrs: the LoRAs' LR grid (empty: eval's three)")
    ap.add_argument("--max-tokens", type=int, default=32768, help="eval --max-tokens: test tokens scored a domain")
    ap.add_argument("--hellaswag", type=Path, default=None, help="eval --hellaswag: every model scored on this"
                    " HellaSwag file (llama-perplexity's layout), paired against the base; a finished run without it"
                    " is evaluated again for it alone")
    ap.add_argument("--hellaswag-tasks", type=int, default=2000, help="eval --hellaswag-tasks")
    ap.add_argument("--eval-tokens", type=int, default=4096, help="train-expert --eval-tokens")
    ap.add_argument("--max-chars-per-domain", type=int, default=None,
                    help="prepare's cap (default: enough for the largest --tokens)")
    ap.add_argument("--test-frac", type=float, default=0.02, help="prepare's test share")
    ap.add_argument("--valid-frac", type=float, default=0.05, help="prepare's validation share")
    ap.add_argument("--prune", action="store_true", help="once a run's line is written, delete its GGUFs and the"
                    " baselines' weights (several GB a run)")
    ap.add_argument("--dry-run", action="store_true", help="print the commands and each run's cost; run nothing")
    ap.add_argument("--train-only", action="store_true", help="train each run's experts and syncs, then stop before"
                    " eval (a sitting with time for the MoE alone; the next run of the study goes on from there)")
    ap.add_argument("--summary-only", action="store_true", help="write study.md and study.png from study.jsonl")
    ap.add_argument("--rerow", action="store_true", help="with --summary-only: first make every finished run's line"
                    " again from its eval report (a study begun before a line held what it holds now)")
    a = ap.parse_args(argv)
    bad = [d for d in [*a.domains, a.held_out] if d not in STUDY_DOMAINS]
    if bad or a.held_out in a.domains or not a.domains:
        sys.exit(f"protocol_study: --domains and --held-out must be distinct domains of {', '.join(STUDY_DOMAINS)}")
    if a.shared == "none" and a.rounds != 1:
        sys.exit("protocol_study: --rounds > 1 needs --shared (rounds merge the shared copies)")
    return a


def main(argv=None) -> None:
    a = parse(argv)
    out = a.out.resolve()
    if a.summary_only:
        if a.rerow:
            print(json.dumps({"lines_made_again": rerow(a, out, shard_ids(out / "template", a.domains))}))
        print(json.dumps(write_summary(out)))
        return
    if not a.dry_run:
        out.mkdir(parents=True, exist_ok=True)
    log = out / "study.log"
    rows = load_rows(out / "study.jsonl")
    check_resumable(a, out / "template", rows)
    template = make_template(a, out, log)
    ids = shard_ids(template, a.domains)
    check_splits(template, a.max_tokens)
    done = {(r["tokens_per_domain"], r["seed"]) for r in rows
            if not a.hellaswag or all("hellaswag" in v for v in r["methods"].values())}
    cfg, why = plan_config(a, template) if a.dry_run else (None, "")
    total = 0.0
    for tokens in a.tokens:
        for seed in a.seeds:
            run = out / f"t{tokens}-s{seed}"
            if (tokens, seed) in done:
                print(f"# {run.name}: done (in study.jsonl)")
                continue
            if short := short_shards(template, ids, tokens):
                print(f"# warning: fewer than {tokens:,} tokens in the shards of {', '.join(short)}: those experts"
                      " see some tokens more than once (raise --max-chars-per-domain in a new --out)", flush=True)
            if a.dry_run:
                if cfg is None:
                    print(f"# {run.name}: cost unknown ({why})")
                else:
                    e = estimate(cfg, tokens, len(ids), a.rounds, a.shared, a.baselines.split(","), a.max_tokens,
                                 gated_moes=2 * len([g for g in a.seed_gates.split(",") if g]),  # top-1 and top-2
                                 grid_points=(len(a.full_lrs.split(",")) if a.full_lrs else None,
                                              len(a.lora_lrs.split(",")) if a.lora_lrs else None),
                                 hellaswag_tasks=a.hellaswag_tasks if a.hellaswag else 0)
                    total += e["seconds"]
                    print(f"# {run.name}: MoE {e['moe_flops']:.3e} training FLOPs"
                          f" ({e['expert_flops_per_token'] / 1e6:.1f} MFLOP a token), baselines with their LR grids"
                          f" {e['baseline_flops']:.3e}; about {e['seconds'] / 3600:.1f} h at {RATE:.1e} FLOP/s"
                          + (f", HellaSwag about {e['hellaswag_s'] / 3600:.1f} h of it" if a.hellaswag else ""))
                if not run.is_dir():
                    print(f"# copy {template} -> {run} (hard links)")
            else:
                copy_template(template, run)
                note_machine(run)
            train_and_eval(a, run, list(ids.values()), tokens, seed, log)
            if a.dry_run or a.train_only:
                continue
            row = result_row(a, run, tokens, seed, ids)
            with open(out / "study.jsonl", "a") as f:
                f.write(json.dumps(row) + "\n")
            if a.prune:
                prune(run)
            print(json.dumps({k: row[k] for k in ("tokens_per_domain", "seed", "moe_chosen")}
                             | {m: round(v["ppl_trained"], 4) for m, v in row["methods"].items()}), flush=True)
    if a.dry_run:
        print(f"# about {total / 3600:.1f} h in all" if total else "# total cost unknown")
    elif load_rows(out / "study.jsonl"):
        print(json.dumps(write_summary(out)))


if __name__ == "__main__":
    main()
