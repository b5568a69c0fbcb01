"""The study regime: does the modular model beat dense, against N experts and R sync rounds?

On the `study` corpus (five real domains from the installed packages and the distribution,
mfgguf/data/study.py), capped per domain:
  1. the corpus is read once into OUT/study.jsonl (then every RUN is prepared from that file, so
     the tokenizer and the trunk's tokens are identical across RUNs: one trunk serves them all);
  2. for each N: `mfgguf prepare ... --partition cluster --experts N` (c-BTM's balanced k-means);
  3. one trunk, trained until its held-out curve flattens, copied into every RUN;
  4. for each (N, R): experts with `--shared S --shared-lr-scale X --rounds R`, `mfgguf sync` after
     each round (the last one recomputes router statistics on the merged model);
  5. `mfgguf eval` with FLOP- and wall-clock-matched dense baselines (shared between the R values of
     one N: the same FLOPs).
One JSON line per configuration (MoE, trunk, baselines, ratios, oracle) and a Markdown table with
plots in OUT. Every step is skipped when its output exists, so the script resumes.

    python scripts/studies/study.py --out study --preset tiny --experts 2,4,8 --rounds 1,2,4,8 --rounds-at 4
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def mfgguf(*args, log: Path) -> None:
    """One CLI verb in its own process, output appended to `log`; stops the study on failure."""
    cmd = [sys.executable, "-m", "mfgguf", *map(str, args)]
    with open(log, "a") as f:
        f.write(f"$ mfgguf {' '.join(map(str, args))}\n")
        f.flush()
        t0 = time.perf_counter()
        rc = subprocess.call(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT)
        f.write(f"# rc={rc} in {time.perf_counter() - t0:.1f} s\n")
    if rc:
        sys.exit(f"study: `mfgguf {args[0]}` failed (exit {rc}); see {log}")


def write_corpus(path: Path, chars: int) -> dict:
    from mfgguf.data.sources import load_documents

    if not path.is_file():
        docs = load_documents(["study"], max_chars_per_domain=chars, progress=False)
        tmp = path.with_suffix(".tmp")
        with open(tmp, "w") as f:
            for d in docs:
                f.write(json.dumps({"domain": d.domain, "text": d.text}) + "\n")
        tmp.replace(path)
    counts: dict[str, int] = {}
    with open(path) as f:
        for line in f:
            d = json.loads(line)
            counts[d["domain"]] = counts.get(d["domain"], 0) + len(d["text"])
    return counts


def install_trunk(src: Path, dst: Path) -> None:
    """Copy src's trained trunk into dst (same tokenizer and trunk tokens, checked), with its manifest entry."""
    from mfgguf.run import RunDir, read_module_meta, sha256_file, update_manifest

    a, b = RunDir(src), RunDir(dst)
    if b.module_meta(0).is_file():
        return
    for f in ("tokenizer.json", "data/train.npy"):
        if sha256_file(src / f) != sha256_file(dst / f):
            sys.exit(f"study: {dst} has another {f} than {src}; prepare both from the same study.jsonl")
    b.modules.mkdir(parents=True, exist_ok=True)
    shutil.copy2(a.module_file(0), b.module_file(0))
    shutil.copy2(a.module_meta(0), b.module_meta(0))
    update_manifest(b, 0, read_module_meta(b, 0))


def record(path: Path):
    """A module's record, typed (a RUN made by an earlier mfgguf read under the current names)."""
    from mfgguf.run.records import ModuleMeta

    return ModuleMeta.from_json(json.loads(path.read_text()))


def copy_run(src: Path, dst: Path) -> None:
    if not dst.exists():
        shutil.copytree(src, dst, ignore=shutil.ignore_patterns("checkpoints", "eval", "rounds"))


def _budget(dense_run: Path) -> int | None:
    meta = dense_run / "modules" / "trunk.json"
    return json.loads(meta.read_text())["tokens_seen"] if meta.is_file() else None


def _budget_plan(run: Path, key: str) -> int | None:
    """Tokens `mfgguf eval` will give baseline `key` (dense-flop / dense-wallclock) for this RUN."""
    from mfgguf.eval.baselines.scratch import plan_baselines
    from mfgguf.run import RunDir, read_module

    rd = RunDir(run)
    metas = {i: read_module(rd, i) for i in range(0, rd.run_info().n_experts + 1)}
    return next((b.tokens for b in plan_baselines(metas, ("flop", "wallclock")) if f"dense-{b.key}" == key), None)


def summarize(run: Path, n: int, r: int) -> dict:
    rep = json.loads((run / "eval" / "report.json").read_text())
    res, g = rep["results"], rep["goals"]
    trunk = record(run / "modules" / "trunk.json").json
    dense = {m["baseline"]: k for k, m in rep["models"].items() if m.get("kind") == "dense"}
    row = {"experts": n, "rounds": r, "best": rep["best"], "moe": res[rep["best"]]["overall"]["ppl"],
           "trunk_synced": res["trunk alone"]["overall"]["ppl"], "oracle": rep["oracle"]["mixed"]["ppl"],
           "flop_dense": res[dense["flop"]]["overall"]["ppl"] if "flop" in dense else None,
           "wallclock_dense": res[dense["wallclock"]]["overall"]["ppl"] if "wallclock" in dense else None,
           "moe_over_flop_dense_mixed": g.get("moe_over_flop_dense_mixed"),
           "moe_over_wallclock_dense_mixed": g.get("moe_over_wallclock_dense_mixed"),
           "moe_beats_trunk_every_domain": g.get("moe_beats_trunk_every_domain"),
           "best_router_vs_oracle": g.get("best_router_vs_oracle"),
           "trained_trunk_validation_loss": trunk.get("trained_validation_loss") or trunk.get("validation_loss"),
           "flops": {k: rep["flops"].get(k) for k in ("total", "critical_path") if k in rep.get("flops", {})}}
    return row


def figure_cells(r: dict) -> str:
    """A row's figures as the last Markdown cells of a study table (this one's and sweep_regime.py's):
    MoE, trunk, oracle, the two dense models, then MoE / wall-clock and MoE / FLOP."""
    return (f" {r['moe']:.2f} | {r['trunk_synced']:.2f} | {r['oracle']:.2f} | {r['wallclock_dense']:.2f} |"
            f" {r['flop_dense']:.2f} | {r['moe_over_wallclock_dense_mixed']:.3f} | {r['moe_over_flop_dense_mixed']:.3f} |")


def plot_ratios(ax, pts: list[tuple[float, dict]], label: str) -> None:
    """MoE / wall-clock dense (solid) and MoE / FLOP dense (dashed) against x, in one colour; pts: [(x, row)]."""
    xs = [p[0] for p in pts]
    line, = ax.plot(xs, [p[1]["moe_over_wallclock_dense_mixed"] for p in pts], "o-", label=f"MoE / wall-clock dense, {label}")
    ax.plot(xs, [p[1]["moe_over_flop_dense_mixed"] for p in pts], "s--", color=line.get_color(),
            label=f"MoE / FLOP dense, {label}")


def table(rows: list[dict]) -> str:
    out = ["| N | R | MoE | trunk (synced) | oracle | dense, wall-clock | dense, FLOP | MoE/wall-clock | MoE/FLOP |",
           "|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    out += [f"| {r['experts']} | {r['rounds']} |" + figure_cells(r) for r in rows]
    return "\n".join(out) + "\n"


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, key, fixed, label in ((axes[0], "experts", "rounds", "N experts"), (axes[1], "rounds", "experts", "R rounds")):
        for f in sorted({r[fixed] for r in rows}):
            pts = sorted(((r[key], r) for r in rows if r[fixed] == f), key=lambda p: p[0])
            if len(pts) < 2:
                continue
            plot_ratios(ax, pts, f"{fixed}={f}")
        ax.axhline(1.0, color="gray", lw=0.8)
        ax.set_xscale("log", base=2)
        ax.set_xlabel(label)
        ax.set_ylabel("MoE perplexity / dense perplexity (mixed)")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path("study"))
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--chars-per-domain", type=int, default=20_000_000, help="cap per domain (5 domains)")
    ap.add_argument("--vocab-size", type=int, default=4096)
    ap.add_argument("--trunk-tokens", type=int, default=6_000_000)
    ap.add_argument("--expert-tokens", type=int, default=1_000_000)
    ap.add_argument("--experts", default="2,4,8", help="N values (R = 1)")
    ap.add_argument("--rounds", default="1,2,4,8", help="R values, at N = --rounds-at")
    ap.add_argument("--rounds-at", type=int, default=4)
    ap.add_argument("--shared", default="all")
    ap.add_argument("--shared-lr-scale", type=float, default=0.1)
    ap.add_argument("--seed-expert", action="store_true", help="train the trunk with the seed FFN experts start from")
    ap.add_argument("--batch-size", type=int, default=None, help="sequences per step, trunk and experts (default: the preset's)")
    ap.add_argument("--train-args", default="", help="more options for train-trunk and train-expert, quoted"
                    " (e.g. \"--eval-every 200 --ckpt-every 200\")")
    ap.add_argument("--eval-args", default="", help="more options for `mfgguf eval`, quoted (e.g. \"--max-tokens 8192\")")
    a = ap.parse_args()
    out = a.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    log = out / "study.log"
    batch = (["--batch-size", a.batch_size] if a.batch_size else []) + a.train_args.split()

    t0 = time.perf_counter()
    counts = write_corpus(out / "study.jsonl", a.chars_per_domain)
    print(json.dumps({"corpus": counts, "chars": sum(counts.values()), "s": round(time.perf_counter() - t0, 1)}), flush=True)

    ns = sorted({int(x) for x in a.experts.split(",")} | {a.rounds_at})
    configs = [(n, 1) for n in ns if str(n) in a.experts.split(",")] + \
              [(a.rounds_at, int(r)) for r in a.rounds.split(",") if (a.rounds_at, int(r)) not in [(n, 1) for n in ns]]
    for n in ns:
        base = out / f"n{n}"
        if not (base / "run.json").is_file():
            mfgguf("prepare", out / "study.jsonl", "--out", base, "--experts", n, "--partition", "cluster",
                   "--vocab-size", a.vocab_size, "--seed", 0, "--no-progress", log=log)
    first = out / f"n{ns[0]}"
    if not (first / "modules" / "trunk.json").is_file():
        seed = ["--seed-expert"] if a.seed_expert else []
        mfgguf("train-trunk", first, "--preset", a.preset, "--tokens", a.trunk_tokens, *seed, *batch, "--no-progress",
               log=log)
    trunk = record(first / "modules" / "trunk.json").json
    info = json.loads((first / "run.json").read_text())
    print(json.dumps({"trunk_tokens": trunk["tokens_seen"], "train_tokens": info.get("train_tokens"),
                      "validation_curve": [[s, round(sum(d.values()) / len(d), 4)] for s, _, d in trunk["validation_history"]],
                      "train_s": round(trunk["train_s"], 1)}), flush=True)
    for n in ns[1:]:
        install_trunk(first, out / f"n{n}")

    rows = []
    for n, r in configs:
        run = out / f"n{n}-r{r}"
        copy_run(out / f"n{n}", run)
        if not (run / "eval" / "report.json").is_file():
            for k in range(1, r + 1):
                for i in range(1, n + 1):
                    meta = run / "modules" / f"expert_{i:03d}.json"
                    if meta.is_file() and record(meta).round >= k:
                        continue
                    mfgguf("train-expert", run, "--expert", i, "--tokens", a.expert_tokens, "--shared", a.shared,
                           "--shared-lr-scale", a.shared_lr_scale, "--rounds", r, *batch, "--no-progress", log=log)
                if a.shared != "none" and record(run / "modules" / "trunk.json").syncs < k:
                    mfgguf("sync", run, "--no-progress", log=log)
            # a baseline with the same budget is the same model (same data, seed, code): reuse an earlier
            # configuration's (eval checks the recorded tokens and retrains it when they differ)
            for b in ("dense-flop", "dense-wallclock"):
                for sib in [out / f"n{m}-r{q}" / "eval" / b for m, q in configs]:
                    if sib.is_dir() and sib.parent.parent != run and not (run / "eval" / b).exists() and \
                            _budget(sib) == _budget_plan(run, b):
                        (run / "eval").mkdir(exist_ok=True)
                        shutil.copytree(sib, run / "eval" / b, symlinks=True)
            mfgguf("eval", run, "--routers", "ridge", "--top-k", "1,2", "--baselines", "flop,wallclock",
                   "--quants", "", *a.eval_args.split(), log=log)
        row = summarize(run, n, r)
        rows.append(row)
        print(json.dumps(row), flush=True)
    (out / "study.md").write_text(table(rows))
    plot(rows, out / "study.png")
    print(json.dumps({"table": str(out / "study.md"), "plot": str(out / "study.png"),
                      "wall_s": round(time.perf_counter() - t0, 1)}), flush=True)


if __name__ == "__main__":
    main()
