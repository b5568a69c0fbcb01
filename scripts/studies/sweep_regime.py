"""The regime sweep: does the modular model start to win once the trunk is trained far enough?

For each point T of trunk tokens per non-embedding trunk parameter (`--tpp 10,30,100`), one
`scripts/studies/study.py` run at N experts and R = 1 and R = 4 (`--experts 4 --rounds 1,4`): the trunk
trained on T x its non-embedding parameters tokens, each expert on `--expert-frac` of the trunk's
tokens (the same share at every point, so only the regime moves), then `mfgguf eval` with the
FLOP- and wall-clock-matched dense baselines. Every point reads the same corpus file (written once),
so the tokenizer and data are identical across points; each point resumes where it stopped.

Prints one JSON line per (T, R) and writes OUT/sweep.md (table) and OUT/sweep.png (MoE / dense
against T, one line per baseline and R).

    python scripts/studies/sweep_regime.py --out sweep --tpp 10,30,100
    python scripts/studies/sweep_regime.py --replot docs/results/sweep-regime.jsonl   # its .md table and .png plot
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from study import figure_cells, plot_ratios  # noqa: E402  (scripts/ is on sys.path when run as a script)


def non_embedding_params(preset: str, seed_expert: bool) -> int:
    """Trunk parameters outside the token embedding and the output head (what the regime counts)."""
    from mfgguf.config import get_preset

    return replace(get_preset(preset).model, seed_expert=seed_expert).non_embedding_params()


def _series(r: dict) -> str:
    """A row's recipe beside the regime: N, R, and what the experts train besides their FFN."""
    return f"N={r['experts']}, R={r['rounds']}" + ("" if r.get("shared", "all") == "all" else f", --shared {r['shared']}")


def table(rows: list[dict]) -> str:
    rows = sorted(rows, key=lambda r: (r["tpp"], r["experts"], r.get("shared", "all") != "all", r["rounds"]))
    out = ["| trunk tokens / param | trunk tokens | experts | MoE | trunk alone | oracle | dense, wall-clock | dense, FLOP |"
           " MoE / wall-clock | MoE / FLOP |",
           "|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
    out += [f"| {r['tpp']} | {r['trunk_tokens']:,} | {_series(r)} |" + figure_cells(r) for r in rows]
    return "\n".join(out) + "\n"


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    for k in sorted({_series(x) for x in rows}):
        plot_ratios(ax, sorted(((x["tpp"], x) for x in rows if _series(x) == k), key=lambda p: p[0]), k)
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set_xscale("log")
    ax.set_xlabel("trunk tokens per non-embedding parameter")
    ax.set_ylabel("held-out perplexity ratio (mixed; < 1: MoE wins)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def write(points: list[dict], stem: Path, **extra) -> None:
    """STEM.md (the table) and STEM.png (the plot) of the rows `points`; prints where, with `extra`, as one JSON line."""
    md, png = stem.with_suffix(".md"), stem.with_suffix(".png")
    md.write_text(table(points))
    plot(points, png)
    print(json.dumps({"table": str(md), "plot": str(png), **extra}), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path("sweep"))
    ap.add_argument("--tpp", default="10,30,100", help="trunk tokens per non-embedding parameter, one study per value")
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--experts", type=int, default=4)
    ap.add_argument("--rounds", default="1,4")
    ap.add_argument("--expert-frac", type=float, default=1 / 3, help="each expert's tokens as a share of the trunk's")
    ap.add_argument("--chars-per-domain", type=int, default=20_000_000)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--shared", default="all")
    ap.add_argument("--shared-lr-scale", type=float, default=0.1)
    ap.add_argument("--no-seed-expert", action="store_true", help="trunk without the seed FFN experts start from")
    ap.add_argument("--train-args", default="--eval-every 200 --ckpt-every 200",
                    help="more options for train-trunk and train-expert, quoted (the preset's curve and checkpoint"
                         " every 10 steps cost more than the training at these sizes)")
    ap.add_argument("--eval-args", default="--max-tokens 8192", help="more options for `mfgguf eval`, quoted")
    ap.add_argument("--replot", type=Path, default=None, metavar="JSONL",
                    help="train nothing: rebuild the table and plot from rows this script printed, written beside"
                         " JSONL (.md, .png)")
    a = ap.parse_args()
    if a.replot:
        rows = [json.loads(x) for x in a.replot.read_text().splitlines() if x.strip()]
        rows = [r for r in rows if "experts" in r and "tpp" in r]
        write(rows, a.replot, rows=len(rows))
        return
    out = a.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    seed = not a.no_seed_expert
    params = non_embedding_params(a.preset, seed)
    t0 = time.perf_counter()
    rows = []
    for tpp in [int(x) for x in a.tpp.split(",")]:
        point = out / f"tpp{tpp}"
        point.mkdir(exist_ok=True)
        corpus = out / "study.jsonl"
        if corpus.is_file() and not (point / "study.jsonl").is_file():
            shutil.copy2(corpus, point / "study.jsonl")
        trunk_tokens = tpp * params
        cmd = [sys.executable, str(ROOT / "scripts" / "studies" / "study.py"), "--out", str(point), "--preset", a.preset,
               "--chars-per-domain", str(a.chars_per_domain), "--trunk-tokens", str(trunk_tokens),
               "--expert-tokens", str(int(trunk_tokens * a.expert_frac)), "--experts", str(a.experts),
               "--rounds", a.rounds, "--rounds-at", str(a.experts), "--shared", a.shared,
               "--shared-lr-scale", str(a.shared_lr_scale), "--batch-size", str(a.batch_size),
               *(["--seed-expert"] if seed else []), f"--train-args={a.train_args}",
               f"--eval-args={a.eval_args}"]
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
        if proc.returncode:
            sys.exit(f"sweep: study at {tpp} tokens/parameter failed: {proc.stderr.strip().splitlines()[-1:]}")
        if not corpus.is_file():
            shutil.copy2(point / "study.jsonl", corpus)
        for line in proc.stdout.splitlines():
            d = json.loads(line)
            if "experts" in d and "rounds" in d:
                d.update(tpp=tpp, trunk_tokens=trunk_tokens, non_embedding_params=params, shared=a.shared)
                rows.append(d)
                print(json.dumps(d), flush=True)
    write(rows, out / "sweep", wall_s=round(time.perf_counter() - t0, 1))


if __name__ == "__main__":
    main()
