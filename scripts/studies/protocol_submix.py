"""Protocol studies read on a common set of domains: the data axis across studies that trained different domains.

A study of scripts/studies/protocol_study.py trains one set of domains; its largest size may train fewer of them (the
1,048,576-token point on two domains, where four cost too many sittings). This script puts such studies on one axis:
every finished row of each --studies directory, each method's test perplexity recomputed on the --domains mix alone
(token-weighted over those domains, from the run's eval report: the same test documents, scored once, nothing
chosen), then per size and study the mean and min-max over seeds, the MoE over each method at top-1 and at the
top-k validation chose, the 95% interval over those domains' test documents (seed 1's, paired redraws), and the
verdict protocol_study's summary gives. A row of a study that trained more domains than --domains keeps its MoE of
all its experts (its router may send this mix's tokens to the other experts) and its baselines trained on all its
domains: the table says how many domains each row trained.

    python scripts/studies/protocol_submix.py --studies protocol-study protocol-study-1m --domains man,python --out submix
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path[:0] = [str(ROOT / "scripts" / "bench"), str(ROOT / "scripts" / "studies"), str(ROOT / "scripts")]

import protocol_study as ps  # noqa: E402

GOALS = {"flop": 0.97, "lora": 0.99, "lora-domain": 1.00}  # the goals on the trained mix (top-1)


def submix_row(study: Path, r: dict, domains: list[str], name: str) -> dict | None:
    """Row `r` of `study` with every method's ppl_trained on `domains`, and the document spread of the MoE validation
    chose over each method on them; None where the row did not train every one of `domains`."""
    if not set(domains) <= set(r["trained_domains"]):
        return None
    from mfgguf.eval.measure import mixed
    from mfgguf.eval.spread import spreads

    rep = ps.read_json(study / r["run"] / "eval" / "report.json")
    res = (rep or {}).get("results", {})
    methods, per_domain = {}, {}
    for m, v in r["methods"].items():
        # without the report: the row's perplexity a domain, the domains weighted alike (eval scores as many tokens
        # in each)
        doms = res.get(v["label"], {}).get("domains") or {d: {"nll": math.log(p), "n_tokens": 1}
                                                           for d, p in v["domains"].items()}
        methods[m] = {**v, "ppl_trained": mixed({d: doms[d] for d in domains})["ppl"]}
        per_domain[m] = doms
    spread = {}
    if rep is not None and rep.get("best") in res:
        others = {m: per_domain[m] for m in methods if not m.startswith("moe ")}
        spread = spreads(res[rep["best"]]["domains"], others, domains)
    return {**r, "methods": methods, "study": name, "n_trained": len(r["trained_domains"]),
            "submix_spread": spread}


def load(studies: list[Path], domains: list[str]) -> list[dict]:
    """Every study's rows on `domains`; a size two sources both ran is refused (their rows would pool)."""
    rows, seen = [], {}
    for src in studies:
        # a study directory, or a study.jsonl kept apart from its runs (docs/results'): reports are read beside it
        s, lines, name = (src.parent, src, src.stem) if src.is_file() else (src, src / "study.jsonl", src.name)
        for r in ps.load_rows(lines):
            x = submix_row(s, r, domains, name)
            if x is None:
                continue
            if seen.setdefault(r["tokens_per_domain"], src) != src:
                sys.exit(f"protocol_submix: {seen[r['tokens_per_domain']]} and {src} both ran"
                         f" {r['tokens_per_domain']:,} tokens a domain; pass one of them")
            rows.append(x)
    if not rows:
        sys.exit(f"protocol_submix: no finished row trained every one of {', '.join(domains)}")
    return rows


def markdown(rows: list[dict], summ: dict, domains: list[str]) -> str:
    L = [f"# The protocol studies on {' + '.join(domains)}", "",
         f"Test perplexity by llama.cpp (f16) on the {' + '.join(domains)} mix (token-weighted), from each run's"
         " eval report: the documents every row scored once; nothing here is chosen. Mean over seeds, min-max"
         " beside it; \"ahead\"/\"behind\" only where the gap between means exceeds the wider seed range. The"
         " interval: seed 1's 95% over paired redraws of these domains' test documents.", ""]
    for t, s in summ["sizes"].items():
        rs = [r for r in rows if r["tokens_per_domain"] == t]
        r0 = min(rs, key=lambda r: r["seed"])
        L += [f"## {t:,} tokens a domain: {r0['study']}, {r0['n_trained']} domains trained"
              f" ({', '.join(r0['trained_domains'])}), seeds {', '.join(map(str, s['seeds']))}", "",
              "| method | test ppl | min-max | training FLOPs | MoE top-1 / it | min-max | verdict |"
              " MoE (validation's k) / it | 95% over documents (seed 1) | verdict |",
              "|---|---:|---:|---:|---:|---:|---|---:|---:|---|"]
        for m, f in s["methods"].items():
            cells = []
            for _, sfx in ps.HEADS.values():
                rt = s.get("ratios" + sfx, {}).get(m)
                cells.append((f"{rt['mean']:.4f}", ps.min_max(rt), s["verdicts" + sfx][m]) if rt else ("", "", ""))
            iv = r0["submix_spread"].get(m)
            doc = f"{iv['low']:.3f}-{iv['high']:.3f}" if iv else ""
            L.append(f"| {ps.NAMES.get(m, 'MoE ' + m[4:])} | {f['ppl_trained']['mean']:.4f} | {ps.min_max(f['ppl_trained'])} |"
                     f" {f['flops']['mean']:.3e} | {' | '.join(cells[0])} | {cells[1][0]} | {doc} | {cells[1][2]} |")
        L.append("")
    L += ["![the MoE over each method against tokens a domain](submix.png)"]
    return "\n".join(L) + "\n"


def plot(summ: dict, domains: list[str], path: Path) -> None:
    """MoE top-1 over each method against tokens a domain (bars: the seeds' range), with the goals' lines."""
    from mfgguf.plots import pyplot, save_figure

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7.5, 4.6))
    for m in ("flop", "wallclock", "lora", "lora-domain"):
        pts = [(t, s["ratios_top1"][m]) for t, s in summ["sizes"].items() if m in s.get("ratios_top1", {})]
        if not pts:
            continue
        ys = [p[1]["mean"] for p in pts]
        err = [[y - p[1]["min"] for y, p in zip(ys, pts)], [p[1]["max"] - y for y, p in zip(ys, pts)]]
        line = ax.errorbar([p[0] for p in pts], ys, yerr=err, marker="o", capsize=3, label=ps.NAMES[m])
        if m in GOALS:
            ax.axhline(GOALS[m], color=line[0].get_color(), lw=0.8, linestyle=":")
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set_xscale("log", base=2)
    sizes = list(summ["sizes"])
    ax.set_xticks(sizes, [f"{t:,}" for t in sizes])
    ax.minorticks_off()
    ax.margins(x=0.1)
    ax.set(xlabel="training tokens a domain", ylabel=f"MoE top-1 / method, test ppl on {' + '.join(domains)}",
           title="below 1: the MoE ahead; dotted: the goals; bars: the seeds' range")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    save_figure(fig, path, plt)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--studies", type=Path, nargs="+", required=True,
                    help="protocol_study.py --out directories, or study.jsonl files (a row whose run's eval report is"
                    " not beside it is read from the row: equal weights a domain, no document interval)")
    ap.add_argument("--domains", required=True, help="the common mix, e.g. man,python")
    ap.add_argument("--out", type=Path, required=True, help="where submix.md, submix.png and submix.json go")
    a = ap.parse_args(argv)
    domains = [d.strip() for d in a.domains.split(",") if d.strip()]
    rows = load([s.resolve() for s in a.studies], domains)
    summ = ps.summarize(rows)
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "submix.md").write_text(markdown(rows, summ, domains))
    plot(summ, domains, a.out / "submix.png")
    sizes = {t: {"study": next(r["study"] for r in rows if r["tokens_per_domain"] == t),
                 "ratios_top1": {m: v["mean"] for m, v in s.get("ratios_top1", {}).items()},
                 "verdicts_top1": s.get("verdicts_top1", {})} for t, s in summ["sizes"].items()}
    (a.out / "submix.json").write_text(json.dumps({"domains": domains, "sizes": sizes}, indent=1) + "\n")
    print(json.dumps({"domains": domains, "sizes": {t: v["ratios_top1"] for t, v in sizes.items()}}))


if __name__ == "__main__":
    main()
