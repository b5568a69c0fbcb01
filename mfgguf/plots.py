"""PNG plots with matplotlib's Agg backend (no display needed): loss curves, generic line charts and
the figures of `mfgguf eval`'s report (perplexity by domain, routing confusion, held-out curves).

Example:
    >>> line_plot("loss.png", {"train": ([0, 1, 2], [5.0, 4.1, 3.7])}, xlabel="tokens", ylabel="loss")
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from mfgguf.run import atomic_path


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def line_plot(path: Path, series: dict[str, tuple[list, list]], *, points: dict[str, tuple[float, float]] | None = None,
              hlines: dict[str, float] | None = None, title: str = "", xlabel: str = "", ylabel: str = "",
              logx: bool = False) -> Path:
    """Lines (label -> (xs, ys)), marked points (label -> (x, y)) and horizontal reference lines; writes a PNG."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=110)
    for label, (xs, ys) in series.items():
        ax.plot(xs, ys, label=label, linewidth=1.2)
    # Points and reference lines share colours by position (C1, C2, ...): the i-th point and the
    # i-th line describe the same thing (e.g. a domain's held-out loss now and the trunk's).
    for i, (label, (x, y)) in enumerate((points or {}).items()):
        ax.scatter([x], [y], label=label, zorder=3, s=28, color=f"C{(i + 1) % 10}")
    for i, (label, y) in enumerate((hlines or {}).items()):
        ax.axhline(y, linestyle="--", linewidth=0.9, color=f"C{(i + 1) % 10}", label=label)
    if logx:
        ax.set_xscale("log")
    ax.set(title=title, xlabel=xlabel, ylabel=ylabel)
    ax.grid(alpha=0.3)
    if series or points or hlines:
        ax.legend(fontsize=8)
    fig.tight_layout()
    path = Path(path)
    with atomic_path(path, suffix=".png") as tmp:
        fig.savefig(tmp, format="png")
    plt.close(fig)
    return path


def loss_curve(path: Path, history: list, *, heldout: dict[str, float] | None = None,
               reference: dict[str, float] | None = None, curve: list | None = None, title: str = "") -> Path:
    """Train loss vs tokens (history rows [step, tokens, loss]), held-out losses as points at the end,
    the held-out mean-loss curve (rows [step, tokens, {domain: loss}]) and optional reference
    losses (e.g. the trunk's held-out loss) as dashed lines."""
    xs = [h[1] for h in history]
    ys = [h[2] for h in history]
    lines = {"train": (xs, ys)}
    if curve:
        lines["held-out mean"] = ([c[1] for c in curve], [sum(c[2].values()) / max(1, len(c[2])) for c in curve])
    end = xs[-1] if xs else 0
    pts = {f"held-out {d}": (end, v) for d, v in (heldout or {}).items() if v == v}  # skip NaN
    refs = {f"trunk held-out {d}": v for d, v in (reference or {}).items() if v == v}
    return line_plot(path, lines, points=pts, hlines=refs, title=title,
                     xlabel="tokens seen", ylabel="cross-entropy (nats/token)")


def _save(fig, path: Path, plt) -> Path:
    """Write the figure as a PNG in one piece (no half-written file where a good one was)."""
    with atomic_path(Path(path), suffix=".png") as tmp:
        fig.savefig(tmp, format="png", dpi=110)
    plt.close(fig)
    return Path(path)


def eval_plots(r: dict, out: Path) -> None:
    """The PNGs report.md shows, from report.json's content `r`: ppl_by_domain, routing_confusion, curves."""
    plt = _plt()
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
    _save(fig, out / "ppl_by_domain.png", plt)

    eval_curves_plot(r, out / "curves.png")

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
    _save(fig, out / "routing_confusion.png", plt)


def eval_curves_plot(r: dict, path: Path) -> Path:
    """Held-out mean loss of the trunk and every dense baseline during training, against tokens and FLOPs;
    stars: each model's final llama.cpp loss (mean over domains), the MoE at the modular run's totals."""
    plt = _plt()
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
    return _save(fig, path, plt)
