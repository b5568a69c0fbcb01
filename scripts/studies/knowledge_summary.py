"""The knowledge study's summary (scripts/studies/knowledge_study.py --summarise): its lines read back, phase 1's
epochs and phase 2's methods (paired across runs by knowledge_phase2.py) as a Markdown table and a figure."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import knowledge_phase2 as kp

SETS = kp.SETS
NAMES = {"moe": "MoE top-1 (ridge)", "flop": "continued pretraining, FLOP-matched",
         "lora": "one LoRA r16, FLOP-matched",
         "lora-domain": "a LoRA per domain", "base": "the base"}


def load_rows(path: Path) -> list[dict]:
    """The study's lines, the last one of each run."""
    rows = {}
    for line in path.read_text().splitlines() if path.is_file() else []:
        if line.strip():
            r = json.loads(line)
            rows[r["run"]] = r
    return list(rows.values())


def pick_epochs(acc: dict[int, float]) -> int:
    """The epochs of the highest accuracy, the fewest among equals (max keeps the first it meets)."""
    return max(sorted(acc), key=lambda e: acc[e])


# ---- the summary ----------------------------------------------------------------------------------------------


def spread(vals: list[float]) -> dict:
    return {"mean": sum(vals) / len(vals), "min": min(vals), "max": max(vals), "n": len(vals)}


def verdict(points: list[float], intervals: list[list[float]], up: str = "gain", down: str = "loss") -> str:
    """A paired difference over seeds: `up` / `down` only where its mean exceeds the seeds' spread (max - min) and
    every seed's paired 95% interval is on that side of zero; "one seed" with fewer than two."""
    if len(points) < 2:
        return "one seed"
    s = spread(points)
    width = s["max"] - s["min"]
    if s["mean"] > width and all(lo > 0 for lo, _ in intervals):
        return up
    if -s["mean"] > width and all(hi < 0 for _, hi in intervals):
        return down
    return "within the noise"


def summarize(rows: list[dict], epochs: list[int] | None = None) -> dict:
    """{"phase1": {epochs: figures}, "chosen", "phase2": knowledge_phase2.py's summary, paired across runs}; "chosen"
    is None while a run of the planned `epochs` is missing (phase 1 not done: nothing is chosen yet)."""
    p1 = sorted((r for r in rows if r.get("phase") == 1), key=lambda r: r["epochs"])
    phase1 = {r["epochs"]: {**r["valid_questions"], "valid_ppl": r["valid_ppl"], "valid_ppl_base": r["valid_ppl_base"]}
              for r in p1}
    # the rule over every phase-1 run, the extension included
    done = bool(phase1) and all(e in phase1 for e in epochs or ())
    chosen = pick_epochs({e: f["accuracy"] for e, f in phase1.items()}) if done else None
    out = {"phase1": phase1, "chosen": chosen}
    p2 = kp.summarize_phase2(rows, spread, verdict)
    if p2:
        out["phase2"] = p2
    return out


def _pm(s: dict, fmt: str = "{:+.1f}") -> str:
    return f"{fmt.format(s['mean'])} ({fmt.format(s['min'])} to {fmt.format(s['max'])})" if s["n"] > 1 \
        else fmt.format(s["mean"])


def markdown(rows: list[dict], summ: dict) -> str:
    cpus = sorted({f"{m['model']} ({m['class']}, {m['cores']} cores)" for r in rows for m in r.get("machines", [])})
    r0 = rows[0]
    L = ["# Knowledge study: closed-book questions about the training documents", "",
         f"Base {r0['recipe']['base']}; trained domains {', '.join(r0['recipe']['domains'])}; recipe "
         + ", ".join(f"{k} {v}" for k, v in r0["recipe"].items() if k not in ("base", "domains")) + ".",
         f"CPU: {'; '.join(cpus) or 'not recorded'}.", "", "## Phase 1: epochs (validation questions, one seed)", "",
         "| epochs | questions right | accuracy | - base, points | paired 95% interval | validation ppl (each"
         " expert, its domain) |", "|---:|---:|---:|---:|---:|---|"]
    for e, f in summ["phase1"].items():
        ppl = ", ".join(f"{d} {v:.3f} (base {f['valid_ppl_base'][d]:.3f})" for d, v in f["valid_ppl"].items())
        L.append(f"| {e}{' (chosen)' if e == summ['chosen'] else ''} | {f['correct']}/{f['tasks']} |"
                 f" {100 * f['accuracy']:.1f}% | {f['points']:+.1f} | {f['low']:+.1f} to {f['high']:+.1f} | {ppl} |")
    L += ["", "Choice: the highest validation-question accuracy, ties to fewer epochs"
          + ("." if summ["chosen"] is not None else "; none yet, while phase 1 has runs to go.")]
    p2 = summ.get("phase2")
    if p2:
        L += ["", f"## Phase 2: methods at {p2['epochs']} epochs (seeds {', '.join(map(str, p2['seeds']))})", "",
              "Accuracy: mean over seeds (min to max). The difference to the base is paired over the questions, each"
              " seed's 95% interval listed; \"gain\" / \"loss\" only where the mean exceeds the seeds' spread and"
              " every seed's interval excludes zero. The MoE's difference to each method is judged the same way."]
        for b in SETS:
            ms = {m: f[b] for m, f in p2["methods"].items() if b in f}
            if not ms:
                continue
            L += ["", f"### {b} ({next(iter(ms.values()))['tasks']} tasks)", "",
                  "| method | accuracy, % | - base, points | each seed's interval | verdict | MoE - method, points |"
                  " MoE verdict |", "|---|---:|---:|---|---|---:|---|"]
            for m, f in ms.items():
                acc = {k: 100 * v for k, v in f["accuracy"].items() if k != "n"} | {"n": f["accuracy"]["n"]}
                iv = "; ".join(f"{lo:+.1f} to {hi:+.1f}" for lo, hi in f["intervals"]) if m != "base" else ""
                vm = f.get("vs_moe")
                L.append(f"| {NAMES[m]} | {_pm(acc, '{:.1f}')} | {_pm(f['points']) if m != 'base' else ''} | {iv} |"
                         f" {f['verdict']} | {_pm(vm['points']) if vm else ''} | {vm['verdict'] if vm else ''} |")
        L += ["", "### Test perplexity", "", "| method | trained domains | untrained domains |", "|---|---:|---:|"]
        for m, f in p2["methods"].items():
            u = f.get("ppl_test_untrained")
            L.append(f"| {NAMES[m]} | {_pm(f['ppl_test_trained'], '{:.3f}')} | {_pm(u, '{:.3f}') if u else ''} |")
    L += ["", "![question accuracy against epochs and by method](knowledge-study.png)"]
    return "\n".join(L) + "\n"


def plot(summ: dict, path: Path) -> None:
    """Left: validation-question accuracy against epochs (the base dotted). Right: each method's accuracy on the
    questions about the training documents and about the test documents, mean over seeds, bars min to max."""
    from mfgguf.plots import pyplot, save_figure

    plt = pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.6))
    p1 = summ["phase1"]
    if p1:
        es = sorted(p1)
        left.plot(es, [100 * p1[e]["accuracy"] for e in es], marker="o", label="MoE, validation questions")
        left.axhline(100 * p1[es[0]]["base_accuracy"], color="gray", lw=0.8, linestyle=":", label="the base")
        if summ["chosen"] is not None:
            left.axvline(summ["chosen"], color="green", lw=0.8, linestyle="--", label="chosen")
        left.set_xscale("log", base=2)
        left.set_xticks(es, [str(e) for e in es])
        left.minorticks_off()
    left.set(xlabel="epochs of each shard", ylabel="question accuracy, %", title="phase 1: epochs")
    left.grid(alpha=0.3)
    left.legend(fontsize=8)
    p2 = summ.get("phase2")
    if p2:
        ms = list(p2["methods"])
        for j, b in enumerate(("questions-train-test", "questions-test")):
            xs = [i + (j - 0.5) * 0.38 for i in range(len(ms))]
            vals = [p2["methods"][m].get(b, {}).get("accuracy") for m in ms]
            ys = [100 * v["mean"] if v else 0.0 for v in vals]
            err = [[100 * (v["mean"] - v["min"]) if v else 0 for v in vals],
                   [100 * (v["max"] - v["mean"]) if v else 0 for v in vals]]
            right.bar(xs, ys, width=0.38, yerr=err, capsize=3,
                      label="about training documents" if j == 0 else "about test documents")
        right.set_xticks(range(len(ms)), [NAMES[m] for m in ms], rotation=20, ha="right", fontsize=8)
        right.set(ylabel="question accuracy, %", title=f"phase 2: methods at {p2['epochs']} epochs")
        right.legend(fontsize=8)
        right.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    save_figure(fig, path, plt)


def write_summary(out: Path, epochs: list[int] | None = None) -> dict:
    rows = load_rows(out)
    if not rows:
        sys.exit(f"knowledge_study: {out} holds no finished run yet")
    summ = summarize(rows, epochs)
    md, png = out.with_suffix(".md"), out.with_suffix(".png")
    md.write_text(markdown(rows, summ).replace("(knowledge-study.png)", f"({png.name})"))
    plot(summ, png)
    return {"rows": len(rows), "chosen": summ["chosen"], "table": str(md), "plot": str(png)}
