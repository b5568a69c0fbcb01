"""`mfgguf eval RUN`: does assembling independently trained modules, without retraining, work?

Every figure is measured by llama.cpp on a GGUF written by `mfgguf assemble`, on the held-out
split no module trained on:
  - the assembled MoE for each router method, top-1 and top-2 (at `base_quant`, f16 by default);
  - the trunk alone (anchor only, no experts);
  - oracle routing: each domain's text through a model holding only its best expert;
  - dense baselines trained from scratch with the same code on the union of all shards, budgeted
    in training FLOPs (mfgguf/baselines.py, mfgguf/flops.py): FLOP-matched and wall-clock-matched
    with the MoE's active parameters per token, and optionally FLOP-matched with its total ones;
  - q8_0 and q4_k against f16 of the assembled MoE with the best router.
Plus per-layer routing accuracy (from the PyTorch reference with the same router weights),
llama.cpp prompt/decode tokens/s and peak RSS per model (each model in its own process), and the
held-out loss curves of the trunk and every baseline against tokens and training FLOPs.
Writes report.md, report.json and PNG plots into RUN/eval/ (or `out`).
"""

from __future__ import annotations

import json
import math
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from .baselines import flops_section, plan_baselines, train_baseline
from .errors import MfggufError
from .flops import rounds_of, trunk_step_flops
from .run import RunDir, link_or_copy, read_module_meta, router_stats_current, update_manifest, write_json, write_text
from .stages import run_stage

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
    max_tokens_per_domain: int = 32768  # held-out tokens scored per domain (bounds the run time)
    ctx: int | None = None  # perplexity window; None = the model's training context
    decode_tokens: int = 64  # tokens generated to measure decode speed


def evaluate(run: Path, out: Path | None = None, cfg: EvalConfig = EvalConfig(), *, force: bool = False) -> dict:
    """Compare the assembled MoE against the trunk alone, oracle routing and FLOP- and wall-clock-matched dense models.

    Perplexity per domain and on the mixed held-out set, measured by llama.cpp on GGUFs written
    by `mfgguf assemble`; routing accuracy per layer; q8_0/q4_k against f16; tokens/s and peak
    RSS per model. Writes report.md (tables), report.json (raw figures) and PNG plots.
    """
    from .converters.assemble import assemble

    rd = RunDir(run)
    info = rd.info()
    n = info["n_experts"]
    metas = {i: read_module_meta(rd, i) for i in range(0, n + 1)}
    if "ridge" in cfg.routers and not router_stats_current(rd) and any(int(metas[i].get("version", 1)) > 1 for i in metas if i):
        from .train.pooled import pool_router_stats

        _say("router statistics (mfgguf router-stats)")  # the ridge router needs them; stale or missing here
        pool_router_stats(rd.root, progress=False)
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
            assemble(rd.root, path, force=True, progress=False, **kw)
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
    for d, e in best_expert.items():
        models[f"oracle {d}"] = {"path": build(f"oracle-{d}-{cfg.base_quant}", quant=cfg.base_quant, experts=[e]),
                                 "kind": "oracle", "domains": [d], "expert": e}
    plans = plan_baselines(metas, cfg.baselines) if cfg.dense else []
    dense_metas = {}
    for b in plans:
        dense = train_baseline(rd, metas[0], b, out, force)
        dense_metas[b.label] = read_module_meta(dense, 0)
        path = models_dir / f"dense-{b.key}-{cfg.base_quant}.gguf"
        if force or not path.is_file() or path.stat().st_mtime < dense.module_file(0).stat().st_mtime:
            assemble(dense.root, path, quant=cfg.base_quant, experts=[], force=True, progress=False)
        models[b.label] = {"path": path, "kind": "dense", "baseline": b.key, "anchor_ff": b.anchor_ff,
                           "tokens": dense_metas[b.label]["tokens_seen"]}

    results = {}
    for name, m in models.items():
        _say(f"measure {name}")
        results[name] = _measure(m["path"], rd, m.get("domains", domains), cfg)

    moe_names = [k for k, m in models.items() if m["kind"] == "moe"]
    best = min(moe_names, key=lambda k: results[k]["overall"]["ppl"])
    best_router, best_k = models[best]["router"], models[best]["top_k"]
    quant_rows = {cfg.base_quant: results[best]}
    for q in cfg.quants:
        p = build(f"moe-{best_router}-top{best_k}-{q}", quant=q, router=best_router, top_k=best_k)
        _say(f"measure {best} {q}")
        quant_rows[q] = _measure(p, rd, domains, cfg)
        models[f"{best} {q}"] = {"path": p, "kind": "quant"}
        results[f"{best} {q}"] = quant_rows[q]

    _say("routing accuracy")
    routing = {r: _routing_accuracy(rd, domains, heldout, build(f"moe-{r}-top1-{cfg.base_quant}", quant=cfg.base_quant,
                                                                 router=r, top_k=1))
               for r in cfg.routers}

    oracle_mixed = _mixed({d: results[f"oracle {d}"]["domains"][d] for d in domains})
    stats_moe = [k for k in moe_names if models[k]["router"] in STATS_ROUTERS]
    best_stats = min(stats_moe, key=lambda k: results[k]["overall"]["ppl"]) if stats_moe else None
    report = {
        "run": str(rd.root),
        "config": asdict(cfg),
        "domains": domains,
        "models": {k: {**{kk: vv for kk, vv in m.items() if kk != "path"}, "file": m["path"].name,
                       "bytes": m["path"].stat().st_size} for k, m in models.items()},
        "results": results,
        "oracle": {"experts": best_expert, "mixed": oracle_mixed},
        "recipe": recipe(metas),
        "best": best,
        "best_stats_router": best_stats,
        "quant": {q: r["overall"]["ppl"] for q, r in quant_rows.items()},
        "routing": routing,
        "goals": _goals(results, best, best_stats, oracle_mixed, quant_rows, cfg, domains, plans),
        "flops": flops_section(metas, dense_metas, plans),
        "curves": _curves(metas[0], dense_metas),
        "wall_s": round(time.perf_counter() - t_start, 1),
    }
    write_json(out / "report.json", report)
    _plots(report, out)
    write_text(out / "report.md", report_markdown(report))
    return report


# ---- models ------------------------------------------------------------------------------------


def _best_expert_per_domain(metas: dict, domains: list[str]) -> dict[str, int]:
    """The oracle's choice: for each domain the expert with the lowest held-out loss on it."""
    best = {}
    for d in domains:
        losses = {i: m["heldout_loss"][d] for i, m in metas.items() if i > 0 and d in m.get("heldout_loss", {})}
        if not losses:
            raise MfggufError(f"no expert recorded a held-out loss on domain {d!r}; retrain the experts with this mfgguf")
        best[d] = min(losses, key=losses.get)
    return best


def _measure(path: Path, rd: RunDir, domains: list[str], cfg: EvalConfig) -> dict:
    """Perplexity per domain, tokens/s and peak RSS of one GGUF, in a process of its own."""
    args = [sys.executable, "-m", "mfgguf.evaluate", str(path), str(rd.root), ",".join(domains),
            str(cfg.max_tokens_per_domain), str(cfg.ctx or 0), str(cfg.decode_tokens)]
    res, text = run_stage(f"measure {path.name}", args, capture=True)
    m = json.loads(text.strip().splitlines()[-1])
    m["peak_rss_mb"] = res.peak_rss_mb
    return m


def _measure_main(path: str, run: str, domains: str, cap: str, ctx: str, decode: str) -> None:
    from .runtime.perplexity import perplexity_by_domain

    rd = RunDir(Path(run))
    held = rd.heldout_tokens(int(cap))
    toks = {d: np.asarray(held[d]) for d in domains.split(",")}
    r = perplexity_by_domain(Path(path), toks, ctx=int(ctx) or None)
    per = {d: {k: v[k] for k in ("ppl", "nll", "n_tokens")} for d, v in r["domains"].items()}
    from .runtime.llm import loaded

    with loaded(Path(path)) as llm:
        t0 = time.perf_counter()
        c = llm.create_completion("def ", max_tokens=int(decode), temperature=0.0, seed=0)
        n_dec, t_dec = c["usage"]["completion_tokens"], time.perf_counter() - t0
    overall = {k: r["overall"][k] for k in ("ppl", "nll", "n_tokens")}  # token-weighted: the mixed set
    print(json.dumps({"domains": per, "overall": overall, "prompt_tps": r["overall"]["tokens_per_s"],
                      "decode_tps": n_dec / t_dec if n_dec else float("nan")}))


def _mixed(per: dict) -> dict:
    """Token-weighted perplexity over domains measured by different models (the oracle's mixed set)."""
    n = sum(v["n_tokens"] for v in per.values())
    nll = sum(v["nll"] * v["n_tokens"] for v in per.values()) / n
    return {"ppl": math.exp(nll), "nll": nll, "n_tokens": n}


# ---- routing -------------------------------------------------------------------------------------


def _routing_accuracy(rd: RunDir, domains: list[str], heldout: dict, gguf: Path) -> dict:
    """Per layer, the share of each domain's tokens whose top-1 expert was trained mostly on that domain.

    Uses the PyTorch reference with the router rows read back from the top-1 GGUF, i.e. exactly
    the routing llama.cpp performs (parity tests hold the two forwards together).
    """
    import torch

    from .reference import reference_model

    model, _ = reference_model(rd.root, gguf)
    info = rd.info()
    home = {s["id"]: max(s["domains"], key=s["domains"].get) for s in info["shards"]}  # expert -> its main domain
    n_layers, n_exp = model.cfg.n_layers, len(home)
    counts = np.zeros((len(domains), n_layers, n_exp))  # domain x layer x expert
    ctx = model.cfg.ctx_len
    for di, d in enumerate(domains):
        toks = torch.as_tensor(np.asarray(heldout[d][: (len(heldout[d]) // ctx) * ctx], dtype=np.int64)).view(-1, ctx)

        def hook(layer, x, di=di):
            choice = (x.float() @ model.layers[layer].router.float().T).argmax(-1)  # (B, T)
            counts[di, layer] += np.bincount(choice.flatten().numpy(), minlength=n_exp)

        with torch.no_grad():
            for b in range(0, len(toks), 8):
                model(toks[b: b + 8], route="router", hook=hook)
    share = counts / counts.sum(-1, keepdims=True).clip(min=1)  # domain x layer x expert
    acc = {d: [float(sum(share[di, l, e - 1] for e in home if home[e] == d)) for l in range(n_layers)]
           for di, d in enumerate(domains)}
    return {"accuracy": acc, "confusion": share.mean(1).tolist(), "expert_domain": home}


# ---- report --------------------------------------------------------------------------------------


def _trained_trunk_run(rd: RunDir, out: Path) -> RunDir | None:
    """A RUN view (out/trained-trunk) whose trunk is the one `train-trunk` wrote, before the first sync; None if never synced."""
    before = rd.rounds / "sync_01" / "before"
    if not (before / "trunk.safetensors").is_file():
        return None
    view = RunDir(out / "trained-trunk")
    view.modules.mkdir(parents=True, exist_ok=True)
    for name in ("run.json", "tokenizer.json"):
        (view.root / name).write_bytes((rd.root / name).read_bytes())
    for name in ("trunk.safetensors", "trunk.json"):
        dst = view.modules / name
        dst.unlink(missing_ok=True)
        link_or_copy(before / name, dst)
    update_manifest(view, 0, read_module_meta(view, 0))
    return view


def _goals(results, best, best_stats, oracle_mixed, quant_rows, cfg, domains, plans) -> dict:
    """Ratios of mixed held-out perplexity (lower is better for the MoE); thresholds live in report_markdown."""
    trunk, moe = results["trunk alone"], results[best]
    worst = max(moe["domains"][d]["ppl"] / trunk["domains"][d]["ppl"] for d in domains)
    g = {"moe_beats_trunk_every_domain": worst < 1, "moe_over_trunk_worst_domain": worst}
    if "trunk as trained (before sync)" in results:
        tt = results["trunk as trained (before sync)"]
        g["moe_over_trained_trunk_worst_domain"] = max(moe["domains"][d]["ppl"] / tt["domains"][d]["ppl"] for d in domains)
    if best_stats:
        g["best_router_vs_oracle"] = results[best_stats]["overall"]["ppl"] / oracle_mixed["ppl"]
    for p in plans:
        g[f"moe_over_{p.key}_dense_mixed"] = moe["overall"]["ppl"] / results[p.label]["overall"]["ppl"]
    base = quant_rows[cfg.base_quant]["overall"]["ppl"]
    for q in cfg.quants:
        g[f"{q}_over_{cfg.base_quant}"] = quant_rows[q]["overall"]["ppl"] / base
    return g


def _curves(trunk: dict, dense_metas: dict) -> dict:
    """Held-out mean-loss curves: {model: [[tokens, training FLOPs, mean loss over domains], ...]}."""
    out = {}
    for name, m in {"trunk alone": trunk, **dense_metas}.items():
        per_tok = trunk_step_flops(m["config"]).total
        out[name] = [[t, t * per_tok, sum(h.values()) / len(h)] for _, t, h in m.get("heldout_history") or [] if h]
    return out


def recipe(metas: dict) -> dict:
    """How the modules were trained, from their metadata: what a reader needs to reproduce the row."""
    trunk, experts = metas[0], [m for i, m in metas.items() if i]
    t = (experts[0].get("train") or {}) if experts else {}
    sync = trunk.get("sync") or {}
    return {"experts": len(experts), "seed_expert": bool((trunk.get("config") or {}).get("seed_expert")),
            "shared": t.get("shared", "none"), "shared_lr_scale": t.get("shared_lr_scale", 1.0),
            "rounds": rounds_of(metas), "expert_tokens": t.get("tokens"), "merge": sync.get("merge"),
            "outer_lr": sync.get("outer_lr", 1.0) if sync else None,
            "outer_momentum": sync.get("outer_momentum", 0.0) if sync else None}


def report_markdown(r: dict) -> str:
    ds = r["domains"]
    rc = r.get("recipe") or {}
    how = ", ".join(f"{k} {v}" for k, v in rc.items() if v is not None)
    L = [f"# mfgguf evaluation: {r['run']}", "", *([f"Recipe: {how}.", ""] if how else []),
         f"Held-out perplexity measured by llama.cpp ({r['config']['base_quant']} unless named; "
         f"up to {r['config']['max_tokens_per_domain']} tokens per domain). Lower is better.", "",
         "| model | " + " | ".join(ds) + " | mixed | prompt tok/s | decode tok/s | peak RSS (MB) |",
         "|---|" + "---:|" * (len(ds) + 4)]
    for name, m in r["results"].items():
        if name.startswith("oracle"):
            continue
        cells = [f"{m['domains'][d]['ppl']:.3f}" if d in m["domains"] else "" for d in ds]
        L.append(f"| {name} | " + " | ".join(cells) + f" | {m['overall']['ppl']:.3f} | {m['prompt_tps']:.0f} |"
                 f" {m['decode_tps']:.0f} | {m['peak_rss_mb']:.0f} |")
    orc = [f"{r['results'][f'oracle {d}']['domains'][d]['ppl']:.3f} (expert {r['oracle']['experts'][d]})" for d in ds]
    L.append("| oracle routing | " + " | ".join(orc) + f" | {r['oracle']['mixed']['ppl']:.3f} | | | |")
    g = r["goals"]
    R = r["flops"]["rounds"]
    L += ["", "## Goals", "", f"Best MoE: {r['best']}. Ratios of mixed held-out perplexity (lower favours the MoE).", "",
          "| goal | measured | met |", "|---|---:|:-:|"]

    def row(text: str, key: str, limit: float, *, strict: bool = False) -> None:
        if key not in g:
            L.append(f"| {text} | not measured | n/a |")
        else:
            L.append(f"| {text} | {g[key]:.4f} | {_yes(g[key] < limit if strict else g[key] <= limit)} |")

    row(f"R={R}: MoE at most 0.9x the wall-clock-matched dense model", "moe_over_wallclock_dense_mixed", 0.9)
    row("MoE below the trunk alone on every domain (worst domain ratio)", "moe_over_trunk_worst_domain", 1.0, strict=True)
    if "moe_over_trained_trunk_worst_domain" in g:
        row("... and below the trunk as trained, before any sync (worst domain ratio)",
            "moe_over_trained_trunk_worst_domain", 1.0, strict=True)
    row("MoE at most 1.0x the FLOP-matched dense model", "moe_over_flop_dense_mixed", 1.0)
    row("stretch: MoE at most 0.95x the FLOP-matched dense model", "moe_over_flop_dense_mixed", 0.95)
    row(f"best statistics-only router ({r.get('best_stats_router')}) within 2% of oracle routing", "best_router_vs_oracle",
        1.02)
    if "moe_over_total_dense_mixed" in g:
        L.append(f"| (no goal) MoE / dense with the MoE's total parameters, FLOP-matched"
                 f" | {g['moe_over_total_dense_mixed']:.4f} | |")
    for q, lim in (("q8_0", 1.005), ("q4_k", 1.05)):
        key = f"{q}_over_{r['config']['base_quant']}"
        if key in g:
            L.append(f"| {q} within {100 * (lim - 1):.1f}% of {r['config']['base_quant']} | {g[key]:.4f} | {_yes(g[key] <= lim)} |")
    L += _flops_markdown(r["flops"])
    L += ["", "## Routing accuracy (share of a domain's tokens routed to that domain's experts, top-1)", ""]
    for router, ra in r["routing"].items():
        n_layers = len(next(iter(ra["accuracy"].values())))
        L += [f"**{router}**", "", "| domain | " + " | ".join(f"layer {l}" for l in range(n_layers)) + " |",
              "|---|" + "---:|" * n_layers]
        L += [f"| {d} | " + " | ".join(f"{a:.2f}" for a in acc) + " |" for d, acc in ra["accuracy"].items()]
        L.append("")
    L += ["![perplexity by domain](ppl_by_domain.png)", "", "![routing confusion](routing_confusion.png)", "",
          "![held-out loss curves](curves.png)", "",
          f"Wall time of this evaluation: {r['wall_s']:.0f} s. Raw figures: report.json."]
    return "\n".join(L) + "\n"


def _flops_markdown(f: dict) -> list[str]:
    L = ["", "## Training FLOPs", "",
         "Dense baselines get the tokens that spend their FLOP budget at their own cost per token (whole steps).", "",
         "| model | tokens | training FLOPs | / modular total |", "|---|---:|---:|---:|"]
    for name, m in f["models"].items():
        L.append(f"| {name} | {m['tokens']:,} | {m['flops']:.4e} | {m['flops'] / f['total']:.4f} |")
    L.append(f"| critical path (trunk + {f['rounds']} x longest expert round) | | {f['critical_path']:.4e} |"
             f" {f['critical_path'] / f['total']:.4f} |")
    L += ["", "Per module: " + ", ".join(f"{k} {m['tokens']:,} tokens x {m['flops_per_token']:.4e} FLOPs/token"
                                         for k, m in f["modules"].items()), "", "Formulas (mfgguf/flops.py):", ""]
    L += [f"- {k}: {v}" for k, v in f["formulas"].items()]
    return L


def _yes(b: bool) -> str:
    return "yes" if b else "no"


def _plots(r: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ds = r["domains"]
    names = [n for n in r["results"] if not n.startswith("oracle")]
    fig, ax = plt.subplots(figsize=(max(8, 1.2 * len(names)), 4.5))
    w = 0.8 / (len(ds) + 1)
    for j, d in enumerate([*ds, "mixed"]):
        vals = [r["results"][n]["overall"]["ppl"] if d == "mixed" else r["results"][n]["domains"].get(d, {}).get("ppl", np.nan)
                for n in names]
        ax.bar(np.arange(len(names)) + j * w, vals, w, label=d)
    ax.set_xticks(np.arange(len(names)) + 0.4 - w / 2, names, rotation=35, ha="right", fontsize=8)
    ax.set_ylabel("held-out perplexity (llama.cpp)")
    ax.set_title("Perplexity by domain and model (lower is better)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "ppl_by_domain.png", dpi=110)
    plt.close(fig)

    _curves_plot(r, out, plt)

    ra = r["routing"].get("ridge") or next(iter(r["routing"].values()))
    conf = np.array(ra["confusion"])  # domain x expert
    fig, ax = plt.subplots(figsize=(1.2 + 0.6 * conf.shape[1], 1 + 0.6 * conf.shape[0]))
    im = ax.imshow(conf, vmin=0, vmax=1, cmap="viridis")
    ax.set_yticks(range(len(ds)), ds)
    home = {int(e): d for e, d in ra["expert_domain"].items()}  # JSON turns the int keys into strings
    ax.set_xticks(range(conf.shape[1]), [f"{e}\n({home.get(e, '')})" for e in range(1, conf.shape[1] + 1)], fontsize=7)
    for i in range(conf.shape[0]):
        for j in range(conf.shape[1]):
            ax.text(j, i, f"{conf[i, j]:.2f}", ha="center", va="center", color="w" if conf[i, j] < 0.6 else "k", fontsize=7)
    ax.set_xlabel("expert (its main domain)")
    ax.set_title("Routing (ridge, top-1)\nshare of each domain's tokens,\nmean over layers", fontsize=9)
    fig.colorbar(im)
    fig.tight_layout()
    fig.savefig(out / "routing_confusion.png", dpi=110)
    plt.close(fig)


def _curves_plot(r: dict, out: Path, plt) -> None:
    """Held-out mean loss of the trunk and every dense baseline during training, against tokens and FLOPs;
    stars: each model's final llama.cpp loss (mean over domains), the MoE at the modular run's totals."""
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    models = r["flops"]["models"]
    ends = {"trunk alone": "trunk alone", **{n: n for n in r["curves"] if n != "trunk alone"},
            "moe (trunk + every expert)": r["best"]}
    for ax, col, xlabel in ((axes[0], 0, "training tokens"), (axes[1], 1, "training FLOPs")):
        for j, (name, pts) in enumerate(r["curves"].items()):
            if pts:
                ax.plot([p[col] for p in pts], [p[2] for p in pts], marker=".", color=f"C{j}", label=name)
        for j, (fname, rname) in enumerate(ends.items()):
            res = r["results"].get(rname)
            if res and fname in models:
                nll = float(np.mean([v["nll"] for v in res["domains"].values()]))
                x = models[fname]["tokens"] if col == 0 else models[fname]["flops"]
                ax.scatter([x], [nll], marker="*", s=90, color=f"C{j}", edgecolors="k", zorder=3,
                           label=f"{rname} (llama.cpp, end)" if col == 0 else None)
        ax.set(xlabel=xlabel, ylabel="held-out loss, mean over domains (nats/token)")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.suptitle("Held-out loss during training (lines: PyTorch, curve_tokens per domain; stars: llama.cpp at the end)",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(out / "curves.png", dpi=110)
    plt.close(fig)


def _say(msg: str) -> None:
    from rich.console import Console

    Console(stderr=True).print(f"[bold cyan]eval[/] {msg}", highlight=False)


if __name__ == "__main__":  # the per-model measurement process (see _measure)
    _measure_main(*sys.argv[1:])
