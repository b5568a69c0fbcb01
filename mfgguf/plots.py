"""PNG plots with matplotlib's Agg backend (no display needed): generic line charts and training loss curves.

The floor every stage draws with: train/ imports it, so it imports nothing above run/; the figures
of `mfgguf eval`'s report live in eval/plots.py.

Example:
    >>> line_plot("loss.png", {"train": ([0, 1, 2], [5.0, 4.1, 3.7])}, xlabel="tokens", ylabel="loss")
"""

from __future__ import annotations

from pathlib import Path

from mfgguf.run import atomic_path


def pyplot():
    """matplotlib.pyplot on the Agg backend (imported on first use: most verbs draw nothing)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def line_plot(path: Path, series: dict[str, tuple[list, list]], *, points: dict[str, tuple[float, float]] | None = None,
              hlines: dict[str, float] | None = None, title: str = "", xlabel: str = "", ylabel: str = "",
              logx: bool = False) -> Path:
    """Lines (label -> (xs, ys)), marked points (label -> (x, y)) and horizontal reference lines; writes a PNG."""
    plt = pyplot()
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


def loss_curve(path: Path, history: list, *, validation: dict[str, float] | None = None,
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
    pts = {f"held-out {d}": (end, v) for d, v in (validation or {}).items() if v == v}  # skip NaN
    refs = {f"trunk held-out {d}": v for d, v in (reference or {}).items() if v == v}
    return line_plot(path, lines, points=pts, hlines=refs, title=title,
                     xlabel="tokens seen", ylabel="cross-entropy (nats/token)")


def save_figure(fig, path: Path, plt) -> Path:
    """Write the figure as a PNG in one piece (no half-written file where a good one was) and close it."""
    with atomic_path(Path(path), suffix=".png") as tmp:
        fig.savefig(tmp, format="png", dpi=110)
    plt.close(fig)
    return Path(path)


__all__ = ["pyplot", "line_plot", "loss_curve", "save_figure"]
