"""How many experts, at one data budget: the cluster MoE at several N against what a practitioner runs instead, at
equal training FLOPs, on one test split (docs/studies/experts-count.md).

For each N and seed S, one RUN (OUT/n<N>-s<S>/run):
  1. `import-base` (every expert --expert-ff wide: the same width at every N, so equal tokens are equal FLOPs) and
     `prepare study --partition cluster --experts N`: prepare's own split seed is fixed, so the train, validation and
     test documents are the same at every N (checked: the test split's digest is in every row); only the
     training documents' grouping into clusters changes;
  2. `train-experts --tokens D/N --seed S`: D training tokens in all, whatever N;
  3. `mfgguf eval --seed S`: the MoE (ridge router, top-k chosen on validation), the base, oracle routing. The
     baselines (--baselines: continued pretraining and one LoRA, FLOP-matched; wall-clock-matched on request) train
     once, in the run of --baselines-at: their data is every training document (the union of the clusters, the same
     documents at every N) and their budget the experts' FLOPs, equal at every N (each row records its experts'
     FLOPs and the summary checks they agree). A LoRA per cluster (the stream, domain unknown) trains only where N
     is small enough (--cluster-loras-at). With --score moe, the MoE alone instead, scored as eval scores it (ridge,
     f16, top-1 or top-2 chosen on validation, test once): a later seed's run, compared with the first seed's
     baselines;
  4. each test document through its cluster's expert alone, and the chosen MoE on the same documents
     (mfgguf/eval/cluster_routing.py): the per-document oracle of a cluster MoE;
  5. one JSON line appended to OUT/study.jsonl.
A finished (N, S) is not run again and each stage resumes its own partial work, so the study stops and resumes across
sittings. OUT/study.md and OUT/study.png (test perplexity on the mix against N, and against training FLOPs) are
written from study.jsonl (alone with --summary-only).

    python scripts/studies/experts_count.py --out experts-count --experts 4,16,100 --tokens 409600 --seeds 1
    python scripts/studies/experts_count.py --out experts-count --experts 16,100 --seeds 2 --score moe
    python scripts/studies/experts_count.py --out experts-count --summary-only
    python scripts/studies/experts_count.py --out experts-count --rerow   # after a later `mfgguf eval` in one of its runs
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path[:0] = [str(ROOT / "scripts" / "bench"), str(ROOT / "scripts" / "studies"), str(ROOT / "scripts")]

from protocol_study import mfgguf, read_json, split_digest, spread  # noqa: E402  (one way a study runs a verb)

NAMES = {"moe": "MoE (router, top-k chosen on validation)", "moe top-1": "MoE top-1", "moe top-2": "MoE top-2",
         "oracle": "oracle routing (each domain through its best expert)", "base": "the base",
         "flop": "continued pretraining, FLOP-matched", "wallclock": "continued pretraining, wall-clock-matched",
         "lora": "one LoRA r16, FLOP-matched", "lora-domain": "a LoRA per cluster, the right adapter",
         "lora-stream": "a LoRA per cluster, chosen by each document's opening",
         "cluster-routed": "each document through its cluster's expert (by document)",
         "moe by document": "the MoE, by document",
         "moe stream": "the MoE on the cluster LoRAs' stream (after each opening)"}
BASELINES = ("flop", "wallclock", "lora", "lora-domain", "lora-stream")
EVERY_N = ("flop", "wallclock", "lora")  # trained on every training document: one reference for every N (a LoRA per
# cluster depends on N's clusters, so it is compared within its N)


def run_one(a, n: int, seed: int, out: Path) -> Path:
    """Import, prepare, train and evaluate one (N, seed), each stage only where its output is missing."""
    run = out / f"n{n}-s{seed}" / "run"
    log = run.parent / "study.log"
    run.parent.mkdir(parents=True, exist_ok=True)
    if not (run / "modules" / "trunk.json").is_file():
        mfgguf("import-base", a.base, "--out", run, "--expert-ff", a.expert_ff, "--force", log=log)
    if not (run / "run.json").is_file():
        mfgguf("prepare", "study", "--out", run, "--experts", n, "--partition", "cluster", "--max-chars-per-domain",
               a.max_chars_per_domain, "--test-frac", a.test_frac, "--valid-frac", a.valid_frac,
               "--no-progress", log=log)
    per_expert = a.tokens // n
    t0 = time.perf_counter()
    mfgguf("train-experts", run, "--tokens", per_expert, "--batch-size", a.batch_size, "--seed", seed,
           *(("--lr", a.lr) if a.lr else ()), "--eval-tokens", 512, "--curve-tokens", 512, log=log)  # in a log: a line a job
    train_s = time.perf_counter() - t0
    if a.score == "moe":
        score_moe(a, run, log)
    elif not (run / "eval" / "report.json").is_file():
        base = [b for b, at in ((a.baselines, a.baselines_at), ("lora-domain", a.cluster_loras_at))
                if n == at]
        mfgguf("eval", run, "--routers", "ridge", "--top-k", "1,2", "--quants", "", "--max-tokens", a.max_tokens,
               "--baselines", ",".join(base) or "none", "--dense-schedules", "cosine", "--full-lrs", a.full_lr,
               "--lora-lrs", a.lora_lr, "--seed", seed, log=log)
    routed = run / "eval" / "cluster-routing.json"
    if not routed.is_file() and (not a.route_at or n in a.route_at):
        route_by_cluster(a, run, routed, log)
    return run


def score_moe(a, run: Path, log: Path) -> None:
    """--score moe: the MoE alone, scored as `eval` scores it (ridge router, f16, top-1 and top-2 chosen on validation,
    test scored once, the same measuring process and settings) into eval/measured/top<k>.<split>.json and
    eval/measured/chosen; no baseline, oracle or timing. A second seed costs its training and about five minutes."""
    from mfgguf.eval.measure import measure
    from mfgguf.run import RunDir
    from mfgguf.run.files import write_json

    rd, models, got = RunDir(run), run / "eval" / "models", run / "eval" / "measured"
    models.mkdir(parents=True, exist_ok=True)
    got.mkdir(parents=True, exist_ok=True)
    domains = list(rd.test_tokens(1))

    def scored(k: int, split: str) -> dict:
        path = got / f"top{k}.{split}.json"
        if not path.is_file():
            gguf = models / f"moe-ridge-top{k}-f16.gguf"
            if not gguf.is_file():
                mfgguf("assemble", run, "-o", gguf, "--quant", "f16", "--top-k", k, "--router", "ridge", "--quiet",
                       log=log)
            write_json(path, measure(gguf, rd, domains, max_tokens=a.max_tokens, ctx=None, decode_tokens=0,
                                     split=split))
        return read_json(path)

    k = min((1, 2), key=lambda k: scored(k, "validation")["overall"]["ppl"])
    (got / "chosen").write_text(f"{k}\n")
    scored(k, "test")


def route_by_cluster(a, run: Path, path: Path, log: Path) -> None:
    """eval/cluster-routing.json: each test document through its cluster's expert alone, and the chosen MoE on the
    same documents (mfgguf/eval/cluster_routing.py): the oracle of a cluster MoE, per document."""
    from mfgguf.eval.cluster_routing import cluster_routed
    from mfgguf.run import RunDir
    from mfgguf.run.files import write_json

    label, moe = chosen_moe(run)
    t0 = time.perf_counter()
    r = cluster_routed(RunDir(run), moe, run / "eval" / "scratch", a.max_tokens)
    write_json(path, {**r, "moe_label": label, "wall_s": time.perf_counter() - t0})
    with open(log, "a") as f:
        f.write(f"# cluster routing: {r['routed']['overall']['ppl']:.4f} against the MoE's {r['moe']['overall']['ppl']:.4f}"
                f" per document, {time.perf_counter() - t0:.0f} s\n")


def chosen_moe(run: Path) -> tuple[str, Path]:
    """(label, GGUF) of the MoE validation chose in RUN: eval's best, or --score moe's choice of top-k."""
    if rep := read_json(run / "eval" / "report.json"):
        return rep["best"], run / "eval" / "models" / rep["models"][rep["best"]]["file"]
    k = int((run / "eval" / "measured" / "chosen").read_text())
    return f"moe ridge top-{k}", run / "eval" / "models" / f"moe-ridge-top{k}-f16.gguf"


def _figures(r: dict) -> dict:
    return {"ppl": r["overall"]["ppl"], "domains": {d: v["ppl"] for d, v in r["domains"].items()}}


def eval_methods(rep: dict) -> dict:
    """Each model of an `eval` report: the MoE at each top-k, the chosen one, the dense baselines, base, oracle."""
    res, models, flops = rep["results"], rep["models"], rep["flops"]["models"]
    methods = {}
    for name, m in models.items():
        if m["kind"] == "moe" and name in res and m.get("seed_gate") is None:
            methods[f"moe top-{m['top_k']}"] = {**_figures(res[name]), "label": name,
                                                "validation_ppl": rep.get("validation", {}).get(name, {}).get("ppl")}
            if name == rep["best"]:
                methods["moe"] = {**_figures(res[name]), "label": name}
        elif m["kind"] == "dense" and name in res:
            methods[m["baseline"]] = {**_figures(res[name]), "label": name, "flops": flops.get(name, {}).get("flops")}
    methods["base"] = _figures(res["trunk alone"])
    methods["oracle"] = {"ppl": rep["oracle"]["mixed"]["ppl"], "experts": rep["oracle"]["experts"]}
    if stream := rep.get("domain_stream"):  # by document, on the tokens after each one's opening (the honest part)
        for key, label in (("lora-stream", stream["lora"]), ("moe stream", stream["moe"])):
            methods[key] = {"ppl": stream["results"][label]["after_choice"]["ppl"]}
    return methods


def measured_methods(run: Path) -> dict:
    """`--score moe`'s figures: the MoE at the top-k validation chose (test), and each top-k's validation."""
    got = run / "eval" / "measured"
    k = int((got / "chosen").read_text())
    methods = {}
    for kk in (1, 2):
        test, valid = read_json(got / f"top{kk}.test.json"), read_json(got / f"top{kk}.validation.json")
        if test:
            methods[f"moe top-{kk}"] = {**_figures(test), "label": f"moe ridge top-{kk}",
                                        "validation_ppl": valid["overall"]["ppl"]}
    methods["moe"] = {**methods[f"moe top-{k}"], "label": f"moe ridge top-{k}"}
    return methods


def result_row(a, run: Path, n: int, seed: int) -> dict:
    """study.jsonl's line for one finished RUN: each model's test perplexity (mix and per domain), training FLOPs and
    walls, the cluster partition's balance."""
    from mfgguf.flops import module_flops
    from mfgguf.machine import cpu
    from mfgguf.run import RunDir, read_module

    rep = read_json(run / "eval" / "report.json")
    methods = eval_methods(rep) if rep else measured_methods(run)
    routed = read_json(run / "eval" / "cluster-routing.json")
    if routed:  # every document from an empty KV cache: comparable with each other, not with the rows above
        methods["cluster-routed"] = {"ppl": routed["routed"]["overall"]["ppl"],
                                     "domains": {d: v["ppl"] for d, v in routed["routed"]["domains"].items()}}
        methods["moe by document"] = {"ppl": routed["moe"]["overall"]["ppl"],
                                      "domains": {d: v["ppl"] for d, v in routed["moe"]["domains"].items()}}
    rd = RunDir(run)
    info = read_json(run / "run.json")
    metas = {int(s["id"]): read_module(rd, int(s["id"])) for s in info["shards"]}
    toks = sorted(int(s["tokens"]) for s in info["shards"])
    purity = [max(s["domains"].values()) / max(1, s["tokens"]) for s in info["shards"]] if "domains" in info["shards"][0] else []
    # an imported base's trunk trains nothing: the experts' FLOPs are the run's
    expert_flops = (rep["flops"]["models"]["moe (trunk + every expert)"]["flops"] if rep
                    else sum(module_flops(m) for m in metas.values()))
    return {"n": n, "seed": seed, "tokens": a.tokens, "tokens_per_expert": a.tokens // n, "expert_ff": a.expert_ff,
            "batch_size": a.batch_size, "expert_params": sum(sum(x * y for x, y in m.tensors.values())
                                                              for m in metas.values()) // n,
            "training_flops": expert_flops, "methods": methods,
            "train_wall_s": sum(float(m.wall_s) for m in metas.values()),
            "critical_path_s": max(float(m.wall_s) for m in metas.values()),
            "eval_wall_s": (rep or {}).get("wall_s"), "clusters": {"tokens_min": toks[0], "tokens_median": statistics.median(toks),
                                                          "tokens_max": toks[-1],
                                                          "purity_mean": round(statistics.mean(purity), 3) if purity else None},
            "test_split_sha256": split_digest(run), "test_tokens": {d: v["tokens"] for d, v in info["test"].items()},
            "machine": cpu()}


# ---- the summary ------------------------------------------------------------------------------------------------


def load_rows(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.is_file() else []


def summarize(rows: list[dict]) -> dict:
    """Per N: each method's test perplexity on the mix over seeds; the dense baselines (trained once, at one N, on the
    same documents for the same FLOPs) are every N's reference."""
    by_n: dict[int, dict[str, list[float]]] = {}
    for r in rows:
        for m, v in r["methods"].items():
            by_n.setdefault(r["n"], {}).setdefault(m, []).append(v["ppl"])
    refs: dict[str, list[float]] = {}
    for r in rows:
        for m in EVERY_N + ("base",):
            if m in r["methods"]:
                refs.setdefault(m, []).append(r["methods"][m]["ppl"])
    table = {n: {m: spread(v) for m, v in ms.items()} for n, ms in sorted(by_n.items())}
    ref = {m: spread(v) for m, v in refs.items()}
    # each seed's MoE over the baseline of the same seed (over the baselines' mean where that seed trained none):
    # the range of these is the spread a ratio carries once the baselines have seeds of their own
    by_seed = {m: {r["seed"]: r["methods"][m]["ppl"] for r in rows if m in r["methods"]} for m in refs}
    paired = {n: {m: spread([r["methods"]["moe"]["ppl"] / by_seed[m].get(r["seed"], ref[m]["mean"])
                             for r in rows if r["n"] == n]) for m in refs} for n in by_n}
    digests = {r["test_split_sha256"] for r in rows}
    fl = [r["training_flops"] for r in rows]
    return {"table": table, "reference": ref, "paired": paired, "one_test_split": len(digests) == 1,
            "flops_spread": (max(fl) / min(fl) - 1) if fl else None}


def markdown(rows: list[dict], s: dict) -> str:
    r0 = rows[0]
    L = ["# How many experts at one data budget", "",
         f"{r0['tokens']:,} training tokens in all, split by `prepare --partition cluster` into N experts of "
         f"{r0['expert_ff']} units a layer ({r0['expert_params']:,} parameters each), each trained on its cluster "
         f"for {r0['tokens']:,}/N tokens (batch {r0['batch_size']} sequences); the same test split at every N: "
         f"{'yes' if s['one_test_split'] else 'NO'}; the experts' training FLOPs agree within "
         f"{100 * s['flops_spread']:.2f}%. Test perplexity on the mix of every domain (mean, min-max over seeds).", ""]
    ref = s["reference"]
    L += ["| N | seeds | tokens an expert | MoE (chosen) | top-1 | top-2 | oracle | MoE / base | MoE / continued "
          "| MoE / LoRA | by document: MoE / cluster-routed | stream: MoE / a LoRA per cluster | train wall s "
          "| clusters' tokens min / median / max |",
          "|" + "---|" * 14]
    for n, t in s["table"].items():
        rs = [r for r in rows if r["n"] == n]
        moe = t.get("moe", {}).get("mean")
        ratio = lambda k: _paired(moe, ref.get(k), s["paired"][n].get(k))  # noqa: E731
        c = rs[0]["clusters"]
        L.append(f"| {n} | {len(rs)} | {rs[0]['tokens_per_expert']:,} | {_cell(t.get('moe'))} | {_cell(t.get('moe top-1'))} "
                 f"| {_cell(t.get('moe top-2'))} | {_cell(t.get('oracle'))} | {ratio('base')} | {ratio('flop')} "
                 f"| {ratio('lora')} | {_ratio(t, 'moe by document', 'cluster-routed')} "
                 f"| {_ratio(t, 'moe stream', 'lora-stream')} "
                 f"| {statistics.mean(r['train_wall_s'] for r in rs):.0f} "
                 f"| {c['tokens_min']:,} / {c['tokens_median']:,.0f} / {c['tokens_max']:,} |")
    L += ["", "| reference (every training document: every N's; mean, min-max over seeds) | test perplexity on the mix |",
          "|---|---|"]
    L += [f"| {NAMES[m]} | {_cell(v)} |" for m, v in ref.items()]
    doms = sorted(rows[0]["methods"]["moe"]["domains"])
    L += ["", "Per domain (seed means):", "", "| model | " + " | ".join(doms) + " |", "|---|" + "---|" * len(doms)]
    seen = set()
    for r in rows:
        for m in ("moe", *BASELINES, "base"):
            key = ("base" if m == "base" or m in EVERY_N else f"N={r['n']}", m)
            if m not in r["methods"] or "domains" not in r["methods"][m] or key in seen:
                continue
            seen.add(key)
            same = [x["methods"][m]["domains"] for x in rows if m in x["methods"] and (key[0] == "base" or x["n"] == r["n"])]
            name = NAMES[m] if key[0] == "base" else f"MoE N={r['n']}" if m == "moe" else f"{NAMES[m]}, N={r['n']}"
            L.append(f"| {name} | " + " | ".join(f"{statistics.mean(d[k] for d in same):.3f}" for k in doms) + " |")
    cpus = {f"{r['machine']['model']} ({', '.join(r['machine']['flags'])}; {r['machine']['cores']} cores)" for r in rows}
    L += ["", "CPU: " + "; ".join(sorted(cpus)) + "."]
    return "\n".join(L) + "\n"


def _paired(moe: float | None, ref: dict | None, per_seed: dict | None) -> str:
    """The MoE's seed mean over the baseline's, and the range of the seeds' paired ratios where there are two."""
    if not moe or not ref:
        return ""
    return f"{moe / ref['mean']:.3f}" + (f" ({per_seed['min']:.3f}-{per_seed['max']:.3f})" if per_seed["n"] > 1 else "")


def _ratio(t: dict, a: str, b: str) -> str:
    return f"{t[a]['mean'] / t[b]['mean']:.3f}" if a in t and b in t else ""


def _cell(v: dict | None) -> str:
    if not v:
        return ""
    # one file scored in two runs (the base) gives one figure twice: no range to show
    return f"{v['mean']:.3f}" + (f" ({v['min']:.3f}-{v['max']:.3f})" if v["n"] > 1 and v["min"] != v["max"] else "")


def plot(rows: list[dict], s: dict, path: Path) -> None:
    from mfgguf.plots import pyplot, save_figure

    plt = pyplot()
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 4))
    ns = list(s["table"])
    for m, style in (("moe", "o-"), ("oracle", "s--")):
        ys = [s["table"][n].get(m, {}).get("mean") for n in ns]
        ax.plot([n for n, y in zip(ns, ys) if y], [y for y in ys if y], style, label=NAMES[m])
    for i, (m, v) in enumerate(s["reference"].items()):  # a colour each: the lines are the comparison
        ax.axhline(v["mean"], lw=1.2, ls=":", color="k" if m == "base" else f"C{i + 2}", label=NAMES[m])
    ax.set_xscale("log")
    ax.set_xticks(ns, [str(n) for n in ns])
    ax.set_xlabel("experts N (same training tokens in all)")
    ax.set_ylabel("test perplexity, mix")
    ax.legend(fontsize=7)
    # a colour for each N and each baseline, a marker for odd and for even seeds (the label names the seed)
    colour = {n: f"C{i}" for i, n in enumerate(ns)}
    colour |= {m: f"C{len(ns) + i}" for i, m in enumerate(("flop", "lora", "wallclock"))}
    for r in sorted(rows, key=lambda r: (r["n"], r["seed"])):
        dot, cross = ("o", "x") if r["seed"] % 2 else ("^", "+")
        bx.scatter(r["training_flops"], r["methods"]["moe"]["ppl"], marker=dot, color=colour[r["n"]],
                   label=f"MoE N={r['n']} s{r['seed']}")
        for m in ("flop", "lora", "wallclock"):
            if m in r["methods"]:
                bx.scatter(r["methods"][m].get("flops") or r["training_flops"], r["methods"][m]["ppl"], marker=cross,
                           color=colour[m], label=f"{NAMES[m]} s{r['seed']}")
    bx.set_xscale("log")
    bx.set_xlabel("training FLOPs")
    bx.set_ylabel("test perplexity, mix")
    bx.legend(fontsize=7)
    fig.tight_layout()
    save_figure(fig, path, plt)  # in one piece, as every plot of the project


def write_summary(out: Path) -> None:
    rows = load_rows(out / "study.jsonl")
    if not rows:
        sys.exit(f"experts_count: no finished run in {out / 'study.jsonl'} yet")
    s = summarize(rows)
    (out / "study.md").write_text(markdown(rows, s))
    plot(rows, s, out / "study.png")
    print(f"experts_count: {out / 'study.md'}, {out / 'study.png'}")


def rerow(a) -> None:
    """Each row of OUT/study.jsonl read again from its run, with the row's own budget and width; replaced at once."""
    from mfgguf.run.files import atomic_path

    rows = []
    for r in load_rows(a.out / "study.jsonl"):
        run = a.out / f"n{r['n']}-s{r['seed']}" / "run"
        like = argparse.Namespace(**{**vars(a), "tokens": r["tokens"], "expert_ff": r["expert_ff"],
                                     "batch_size": r["batch_size"]})
        rows.append(result_row(like, run, r["n"], r["seed"]) if run.is_dir() else r)
    with atomic_path(a.out / "study.jsonl") as tmp:
        tmp.write_text("".join(json.dumps(r) + "\n" for r in rows))


def parse(argv=None):
    ints = lambda x: [int(v) for v in x.split(",") if v]  # noqa: E731
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path("experts-count"))
    ap.add_argument("--base", default="smollm2", help="any `import-base` source")
    ap.add_argument("--experts", type=ints, default=[4, 16, 100], help="the values of N")
    ap.add_argument("--tokens", type=int, default=409_600, help="D: training tokens in all, split evenly over N experts")
    ap.add_argument("--seeds", type=ints, default=[1], help="train-expert's and the baselines' seeds")
    ap.add_argument("--expert-ff", type=int, default=192, help="every expert's width (192 on SmolLM2: ~10M parameters)")
    ap.add_argument("--batch-size", type=int, default=4, help="sequences a step: small, so N=100's experts take steps")
    ap.add_argument("--lr", type=float, default=None, help="the experts' peak LR (default: the preset's)")
    ap.add_argument("--max-chars-per-domain", type=int, default=2_000_000, help="prepare's cap on each domain's text")
    ap.add_argument("--test-frac", type=float, default=0.02, help="prepare's test share")
    ap.add_argument("--valid-frac", type=float, default=0.05, help="prepare's validation share")
    ap.add_argument("--baselines-at", type=int, default=None, help="the N whose run trains the dense baselines"
                    " (default: the first N)")
    ap.add_argument("--baselines", default="flop,lora", help="eval --baselines of that run (flop, wallclock, lora)")
    ap.add_argument("--cluster-loras-at", type=int, default=0, help="the N whose run also trains a LoRA per cluster"
                    " (0: none)")
    ap.add_argument("--route-at", type=ints, default=[], help="the N whose runs score each test document through its"
                    " cluster's expert (default: every N)")
    ap.add_argument("--full-lr", default="3e-4", help="continued pretraining's LR (the protocol study's choice)")
    ap.add_argument("--lora-lr", default="3e-3", help="the LoRAs' LR (the protocol study's choice)")
    ap.add_argument("--score", choices=("eval", "moe"), default="eval", help="eval: `mfgguf eval` in each run (the"
                    " baselines in one); moe: the MoE alone, as eval scores it (a later seed's run)")
    ap.add_argument("--max-tokens", type=int, default=8192, help="eval --max-tokens: test tokens scored a domain")
    ap.add_argument("--summary-only", action="store_true", help="write study.md and study.png from study.jsonl")
    ap.add_argument("--rerow", action="store_true", help="rewrite every row of study.jsonl from its run (after a later"
                    " `mfgguf eval` in it: a second seed's baselines, the cluster LoRAs), then the summary")
    a = ap.parse_args(argv)
    a.baselines_at = a.baselines_at or a.experts[0]
    return a


def main(argv=None) -> None:
    a = parse(argv)
    a.out.mkdir(parents=True, exist_ok=True)
    if a.rerow:
        rerow(a)
    elif not a.summary_only:
        done = {(r["n"], r["seed"]) for r in load_rows(a.out / "study.jsonl")}
        # the baselines' N first: every other N is compared with them
        for n in sorted(a.experts, key=lambda n: n != a.baselines_at):
            for seed in a.seeds:
                if (n, seed) in done:
                    continue
                run = run_one(a, n, seed, a.out)
                with open(a.out / "study.jsonl", "a") as f:
                    f.write(json.dumps(result_row(a, run, n, seed)) + "\n")
    write_summary(a.out)


if __name__ == "__main__":
    main()
