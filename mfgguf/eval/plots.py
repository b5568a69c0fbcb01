"""The figures report.md shows, drawn from report.json's content alone (so a report can be redrawn
without re-measuring): perplexity by domain and model, the routing confusion, held-out curves.

Example:
    >>> eval_plots(json.loads(Path("RUN/eval/report.json").read_text()), Path("RUN/eval"))
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from mfgguf.plots import pyplot, save_figure


def eval_plots(r: dict, out: Path) -> None:
    """The PNGs report.md shows, from report.json's content `r`: ppl_by_domain, routing_confusion, curves."""
    ppl_by_domain_plot(r, out / "ppl_by_domain.png")
    eval_curves_plot(r, out / "curves.png")
    routing_confusion_plot(r, out / "routing_confusion.png")
    if r.get("general"):
        from mfgguf.eval.general import general_plot

        general_plot(r["general"], out)


def ppl_by_domain_plot(r: dict, path: Path) -> Path:
    """Bars: each model's test perplexity per domain and on the mixed set (the oracle rows have one domain each)."""
    plt = pyplot()
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
    return save_figure(fig, path, plt)


def routing_confusion_plot(r: dict, path: Path) -> Path:
    """Domain x expert: the share of each domain's tokens the ridge router (else the first one measured) sends
    to each expert, mean over layers."""
    plt = pyplot()
    ds = r["domains"]
    ra = r["routing"].get("ridge") or next(iter(r["routing"].values()))
    conf = np.array(ra["confusion"])  # domain x expert
    fig, ax = plt.subplots(figsize=(1.2 + 0.6 * conf.shape[1], 1 + 0.6 * conf.shape[0]))
    im = ax.imshow(conf, vmin=0, vmax=1, cmap="viridis")
    ax.set_yticks(range(len(ds)), ds)
    home = {int(e): d for e, d in ra["expert_domain"].items()}  # the file's experts in slot order (JSON: string keys)
    ax.set_xticks(range(conf.shape[1]), [f"{e}\n({d})" for e, d in home.items()], fontsize=7)
    for i in range(conf.shape[0]):
        for j in range(conf.shape[1]):
            ax.text(j, i, f"{conf[i, j]:.2f}", ha="center", va="center", color="w" if conf[i, j] < 0.6 else "k", fontsize=7)
    ax.set_xlabel("expert (its main domain)")
    ax.set_title("Routing (ridge, top-1)\nshare of each domain's tokens,\nmean over layers", fontsize=9)
    fig.colorbar(im)
    fig.tight_layout()
    return save_figure(fig, path, plt)


def eval_curves_plot(r: dict, path: Path) -> Path:
    """Held-out mean loss of the trunk and every dense baseline during training, against tokens and FLOPs;
    stars: each model's final llama.cpp loss (mean over domains), the MoE at the modular run's totals."""
    plt = pyplot()
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
    return save_figure(fig, path, plt)


__all__ = ["eval_plots", "eval_curves_plot", "ppl_by_domain_plot", "routing_confusion_plot"]
