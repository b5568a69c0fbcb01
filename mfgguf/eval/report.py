"""`mfgguf eval`'s report: the goals' ratios, the recipe and training curves of report.json, and report.md.

The research thresholds a report checks the ratios against are its configuration (`Goals`), not
part of the figures: report.json records the ratios, report.md says which goal each one meets.

Example:
    >>> report_markdown(json.loads(Path("RUN/eval/report.json").read_text()), Goals(flop_dense=0.98))
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from mfgguf.config import ModelConfig
from mfgguf.eval.general import general_markdown
from mfgguf.eval.training_flops import rounds_of
from mfgguf.flops import trunk_step_flops
from mfgguf.run import ModuleMeta


@dataclass(frozen=True)
class Goals:
    """Thresholds on ratios of mixed held-out perplexity (MoE / other model; lower favours the MoE)."""

    wallclock_dense: float = 0.9  # MoE at most this x the wall-clock-matched dense model (same critical-path FLOPs)
    flop_dense: float = 1.0  # MoE at most this x the FLOP-matched dense model (same total training FLOPs)
    flop_dense_stretch: float = 0.95  # the stretch goal against the FLOP-matched dense model
    trunk_worst_domain: float = 1.0  # MoE over the trunk alone on its worst domain: strictly below this
    router_vs_oracle: float = 1.02  # best statistics-only router at most this x oracle routing (within 2%)
    quants: tuple[tuple[str, float], ...] = (("q8_0", 1.005), ("q4_k", 1.05))  # quantized copy of the best MoE at
    #                                                                           most this x the base type
    lora_domain_stream: float = 0.97  # MoE at most this x the per-domain LoRAs when a document's domain is unknown
    #                                   (each document picks its adapter by its opening; eval/domain_stream.py)
    general_points: float = 0.5  # the MoE's benchmark accuracy at most this many points below the base's, paired
    #                              over the same tasks (eval/general.py)


def goals(results: dict, best: str, best_stats: str | None, oracle_mixed: dict, quant_rows: dict, base_quant: str,
          quants: tuple[str, ...], domains: list[str], plans: list, stream: dict | None = None) -> dict:
    """report.json's `goals`: ratios of mixed held-out perplexity (lower is better for the MoE), no thresholds.

    `stream` (evaluate.py `_domain_stream`) adds the MoE over the per-domain LoRAs with the domain unknown, on the
    tokens after each document's choice (the goal) and on whole documents (the choice's own tokens included)."""
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
    if stream:
        lora, moe_s = stream["results"][stream["lora"]], stream["results"][stream["moe"]]
        for key, part in (("after_choice", "after_choice"), ("whole_documents", "overall")):
            if lora[part]["ppl"] is not None:  # None: every document was no longer than the opening chosen on
                g[f"moe_over_lora-domain_stream_{key}"] = moe_s[part]["ppl"] / lora[part]["ppl"]
    base = quant_rows[base_quant]["overall"]["ppl"]
    for q in quants:
        g[f"{q}_over_{base_quant}"] = quant_rows[q]["overall"]["ppl"] / base
    return g


def curves(trunk: ModuleMeta, dense_metas: dict[str, ModuleMeta]) -> dict:
    """Held-out mean-loss curves: {model: [[tokens, training FLOPs, mean loss over domains], ...]}."""
    out = {}
    for name, m in {"trunk alone": trunk, **dense_metas}.items():
        per_tok = trunk_step_flops(m.config).total
        out[name] = [[t, t * per_tok, sum(h.values()) / len(h)] for _, t, h in m.validation_history if h]
    return out


def recipe(metas: dict[int, ModuleMeta]) -> dict:
    """How the modules were trained, from their records: what a reader needs to reproduce the row."""
    trunk, experts = metas[0], [m for i, m in metas.items() if i]
    t = experts[0].train if experts else {}
    sync = trunk.sync or {}
    cfg = ModelConfig.from_dict(trunk.config or {})
    seen = trunk.tokens_seen
    return {"experts": len(experts), "seed_expert": bool((trunk.config or {}).get("seed_expert")),
            "shared": t.get("shared", "none"), "shared_lr_scale": t.get("shared_lr_scale", 1.0),
            "rounds": rounds_of(metas), "expert_tokens": t.get("tokens"), "merge": sync.get("merge"),
            "trunk_schedule": trunk.schedule,
            "expert_schedule": t.get("schedule", "cosine") if experts else None,
            "outer_lr": sync.get("outer_lr", 1.0) if sync else None,
            "outer_momentum": sync.get("outer_momentum", 0.0) if sync else None,
            "trunk_tokens_per_param": round(seen / cfg.non_embedding_params(), 1) if seen else None}


def _splits(r: dict) -> str:
    """Which split the table scores and which one the choices read; a RUN without a validation split says so."""
    sp = r.get("splits") or {}
    if not sp:
        return ""
    if sp["validation"] == sp["test"]:
        return (f"This RUN has no validation split (prepared before it existed): choices and figures both read"
                f" data/{sp['test']}/; re-run `mfgguf prepare` for separate splits.")
    return (f"Scored on data/{sp['test']}/ (test) once per model; every choice ({', '.join(sp['chosen_on_validation'])})"
            f" read data/{sp['validation']}/ (validation).")


def report_markdown(r: dict, target: Goals = Goals()) -> str:
    """report.md from report.json's content `r`, each goal checked against `target`; titled by the run's name."""
    ds = r["domains"]
    rc = r.get("recipe") or {}
    how = ", ".join(f"{k} {v}" for k, v in rc.items() if v is not None)
    L = [f"# mfgguf evaluation: {Path(r['run']).name}", "", *([f"Recipe: {how}.", ""] if how else []),
         f"Test perplexity measured by llama.cpp ({r['config']['base_quant']} unless named; "
         f"up to {r['config']['max_tokens_per_domain']} tokens per domain). Lower is better. {_splits(r)}", "",
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
    L += _validation_markdown(r)
    L += _grid_scale_markdown(r)
    g = r["goals"]
    R = r["flops"]["rounds"]
    L += ["", "## Goals", "", f"Best MoE (on validation): {r['best']}. Ratios of mixed test perplexity (lower favours the"
          " MoE).", "",
          "| goal | measured | met |", "|---|---:|:-:|"]

    def row(text: str, key: str, limit: float, *, strict: bool = False) -> None:
        if key not in g:
            L.append(f"| {text} | not measured | n/a |")
        else:
            L.append(f"| {text} | {g[key]:.4f} | {_yes(g[key] < limit if strict else g[key] <= limit)} |")

    t = target
    row(f"R={R}: MoE at most {_x(t.wallclock_dense)}x the wall-clock-matched dense model", "moe_over_wallclock_dense_mixed",
        t.wallclock_dense)
    row("MoE below the trunk alone on every domain (worst domain ratio)", "moe_over_trunk_worst_domain",
        t.trunk_worst_domain, strict=True)
    if "moe_over_trained_trunk_worst_domain" in g:
        row("... and below the trunk as trained, before any sync (worst domain ratio)",
            "moe_over_trained_trunk_worst_domain", t.trunk_worst_domain, strict=True)
    row(f"MoE at most {_x(t.flop_dense)}x the FLOP-matched dense model", "moe_over_flop_dense_mixed", t.flop_dense)
    row(f"stretch: MoE at most {_x(t.flop_dense_stretch)}x the FLOP-matched dense model", "moe_over_flop_dense_mixed",
        t.flop_dense_stretch)
    row(f"best statistics-only router ({r.get('best_stats_router')}) within {100 * (t.router_vs_oracle - 1):g}% of"
        " oracle routing", "best_router_vs_oracle", t.router_vs_oracle)
    if "moe_over_lora_dense_mixed" in g:
        row("MoE at most 1x the base + LoRA with the same FLOPs", "moe_over_lora_dense_mixed", 1.0)
    if "moe_over_lora-domain_dense_mixed" in g:
        row("MoE at most 1x a LoRA per domain with the same FLOPs (client picks)", "moe_over_lora-domain_dense_mixed", 1.0)
    if "domain_stream" in r:
        k = r["domain_stream"]["results"][r["domain_stream"]["lora"]]["choose_tokens"]
        row(f"MoE at most {_x(t.lora_domain_stream)}x a LoRA per domain, domain unknown (each document picks by its"
            f" first {k} tokens; the tokens after them)", "moe_over_lora-domain_stream_after_choice", t.lora_domain_stream)
        if "moe_over_lora-domain_stream_whole_documents" in g:
            L.append(f"| (no goal) the same on whole documents, the {k} tokens chosen on included"
                     f" | {g['moe_over_lora-domain_stream_whole_documents']:.4f} | |")
    if "moe_over_total_dense_mixed" in g:
        L.append(f"| (no goal) MoE / dense with the MoE's total parameters, FLOP-matched"
                 f" | {g['moe_over_total_dense_mixed']:.4f} | |")
    for q, lim in t.quants:
        key = f"{q}_over_{r['config']['base_quant']}"
        if key in g:
            L.append(f"| {q} within {100 * (lim - 1):.1f}% of {r['config']['base_quant']} | {g[key]:.4f} | {_yes(g[key] <= lim)} |")
    L += general_markdown(r.get("general") or {}, r["best"], t.general_points)
    L += _spread_markdown(r.get("test_spread") or {})
    L += _stream_markdown(r.get("domain_stream") or {}, ds)
    L += _flops_markdown(r["flops"])
    L += _schedules_markdown(r.get("dense_schedules") or {})
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


def _validation_markdown(r: dict) -> list[str]:
    """Every MoE candidate on validation, and which ones test scored (of each router and top-k, the seed gate
    validation chose; eval/evaluate.py `finalists`)."""
    val = r.get("validation") or {}
    if not val:
        return []
    L = ["", "## The MoEs on validation", "",
         "Every MoE assembled, scored on validation, where the choices are made: the best is the MoE of the goals"
         " below; of each router and top-k the test split scores only the seed gate (or none) chosen here.", "",
         "| MoE | validation ppl, mixed | on test |", "|---|---:|---|"]
    for name, v in sorted(val.items(), key=lambda kv: kv[1]["ppl"]):
        L.append(f"| {name} | {v['ppl']:.4f} | {'best' if name == r['best'] else 'yes' if name in r['results'] else 'no'} |")
    return L


def _grid_scale_markdown(r: dict) -> list[str]:
    """The MoE validation chose beside every LR grid point, on the grids' own measure (evaluate.py `_on_grid_scale`)."""
    g = r.get("moe_on_grid_scale")
    if not g:
        return []
    L = ["", "## The MoE on the LR grids' measure", "",
         f"Validation loss in nats, mean of the trained domains ({', '.join(g['trained_domains'])}), PyTorch on the first"
         f" {g['eval_tokens']:,} validation tokens a domain ({g['precision']}), as each grid point was chosen; the MoE"
         " through the reference built from its GGUF (its merged trunk, router and top-k).", "",
         "| model | LR | validation loss |", "|---|---:|---:|"]
    for mode, points in g["grid"].items():
        for lr, loss in points.items():
            chosen = " (chosen)" if float(lr) == float(g["chosen_lr"][mode]) else ""
            L.append(f"| {'continued pretraining' if mode == 'full' else 'LoRA r16'}{chosen} | {lr} | {loss:.4f} |")
    return L + [f"| **{g['model']}** | | **{g['mean_trained']:.4f}** |"]


def _spread_markdown(sp: dict) -> list[str]:
    """The best MoE over each other model, with its interval over resampled test documents (eval/spread.py)."""
    if not sp:
        return []
    one = next(iter(sp.values()))
    docs = ", ".join(f"{d} {k}" for d, k in one["documents"].items())
    L = ["", "## Spread over test documents", "",
         f"The best MoE's mixed test perplexity over each model's, with its {100 * one['level']:g}% interval when the"
         f" test documents are drawn again ({one['draws']} paired draws, each domain's documents with replacement;"
         f" documents scored: {docs}). An interval that holds 1 does not tell the two apart on this test split;"
         " seeds are a second spread, of training.", "",
         "| MoE / model | ratio | interval | draws where the MoE is lower |", "|---|---:|---:|---:|"]
    for k, v in sp.items():
        L.append(f"| {k} | {v['ratio']:.4f} | {v['low']:.4f}-{v['high']:.4f} | {v['a_better_share']:.2f} |")
    return L


def _stream_markdown(st: dict, ds: list[str]) -> list[str]:
    """The per-domain LoRAs with the domain unknown against the MoE on the same documents (eval/domain_stream.py)."""
    if not st:
        return []
    res = st["results"]
    lora = res[st["lora"]]
    k = lora["choose_tokens"]
    ppl = lambda f: f"{f['ppl']:.3f}" if f["ppl"] is not None else ""  # noqa: E731
    L = ["", "## Per-domain LoRAs with the domain unknown", "",
         f"Each test document (its tokens and its EOS, from an empty KV cache, windows of {lora['ctx']} overlapping by"
         f" half) is served by the candidate -- the base alone or the base with one adapter -- of lowest loss on its"
         f" first {k} tokens; the MoE scores the same documents with no choice. Perplexity on the tokens after the"
         f" first {k} of each document (the choice never read them), then on whole documents.", "",
         "| model | " + " | ".join(ds) + " | mixed | mixed, whole documents |", "|---|" + "---:|" * (len(ds) + 2)]
    for name in (st["lora"], st["moe"]):
        m = res[name]
        cells = [ppl(m["domains"][d]["after_choice"]) if d in m["domains"] else "" for d in ds]
        L.append(f"| {name} | " + " | ".join(cells) + f" | {ppl(m['after_choice'])} | {ppl(m['overall'])} |")
    own = lora.get("own_choice") or {}
    if own:
        L += ["", "Share of a domain's documents that picked its own candidate (its adapter; the base where none is"
                  " for it): " + ", ".join(f"{d} {own[d]:.2f}" for d in ds if d in own) + "."]
    return L


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
    t = f["modules"].get("trunk") or {}
    if t.get("cooldown_tokens"):
        L += ["", f"The trunk's wsd cooldown after its branch point ({t['cooldown_tokens']:,} tokens,"
                  f" {t['cooldown_flops']:.4e} FLOPs) is counted in its FLOPs and in every total above."]
    return L


def _schedules_markdown(ds: dict) -> list[str]:
    """Which LR schedule each dense baseline kept (the better held-out loss of those it trained with)."""
    if not ds:
        return []
    L = ["", "## Dense baselines' LR schedules", "",
         "Each dense baseline trained with every schedule listed at the same tokens; the row above is the one with"
         " the lower held-out loss (mean over domains, its training's own measurement).", "",
         "| model | kept | " + " | ".join(f"{s} held-out loss" for s in ("cosine", "wsd")) + " |", "|---|---|---:|---:|"]
    for name, d in ds.items():
        cells = [f"{d['validation_loss'][s]:.4f}" if s in d["validation_loss"] else "" for s in ("cosine", "wsd")]
        L.append(f"| {name} | {d['chosen']} | " + " | ".join(cells) + " |")
    return L


def _x(v: float) -> str:
    """A threshold as the report writes it: 0.9, 1.0, 0.95."""
    return f"{v:.1f}" if round(v, 1) == v else f"{v:g}"


def _yes(b: bool) -> str:
    return "yes" if b else "no"


__all__ = ["Goals", "goals", "curves", "recipe", "report_markdown"]
