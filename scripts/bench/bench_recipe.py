"""The whole recipe on one machine against continuing to train the base, for the same data and FLOPs.

The recipe (docs/studies.md): SmolLM2 imported with 768-unit experts, E experts of T tokens with
attention copies merged by R sync rounds (`train-experts --shared attn --shared-lr-scale 0.3
--rounds R --lr 1e-3`: every round of every expert, a sync after each, the final sync's router
statistics), then `assemble --quant q8_0`. Against it: `train-base --mode full` on the same shards
for the FLOPs the experts spent (mfgguf/flops.py, as `eval`'s FLOP-matched baseline counts them),
then its own `assemble --quant q8_0`. `import-base` and `prepare` are common to both and timed apart.

Each command runs as a user runs it (the `mfgguf` CLI, its own process; peak RSS from `wait4`), one
after another on an otherwise idle machine, in the same run, so the ratio is what the machine gives.
`--before REV` also times the recipe as the checkout REV runs it (a `git worktree`), for a lever's
before and after in one run; given the same seed the experts' bytes must agree (`same_bytes`).

Prints JSON lines: one per command (wall s, peak RSS MB), one per side (its wall, the sum), and
the ratio recipe / continued.

    make smollm2 && python scripts/bench/bench_recipe.py                         # ~25 minutes on 2 cores
    python scripts/bench/bench_recipe.py --before 079fee4 --in-process --experts 3 --tokens 65536 --rounds 4
    python scripts/bench/bench_recipe.py --both                       # --processes and --in-process

Continued pretraining runs with `--compile off` and `--compile auto` (compiled: its run is long enough); the
ratio is against the faster. Each side starts with an empty inductor cache (a first run's compile), unless
`--warm-cache`.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def timed(name: str, argv: list, *, root: Path = ROOT, log: Path, cache: Path | None = None) -> dict:
    """Run `python -m mfgguf ARGV` from the checkout `root`; its wall and peak RSS. `cache`: inductor's cache
    directory for the command (torch.compile's compiled kernels), so each side can start cold."""
    env = {**os.environ, "PYTHONPATH": str(root), **({"TORCHINDUCTOR_CACHE_DIR": str(cache)} if cache else {})}
    t0 = time.perf_counter()
    with open(log, "ab") as f:
        p = subprocess.Popen([sys.executable, "-m", "mfgguf", *map(str, argv)], stdout=f, stderr=subprocess.STDOUT,
                             env=env, cwd=root)
        _, status, usage = os.wait4(p.pid, 0)
    rc = os.waitstatus_to_exitcode(status)
    if rc != 0:
        raise SystemExit(f"{name} failed (exit {rc}); see {log}")
    row = {"step": name, "wall_s": round(time.perf_counter() - t0, 1), "peak_rss_mb": round(usage.ru_maxrss / 1024)}
    print(json.dumps(row), flush=True)
    return row


def inductor_cache(work: Path, label: str, args) -> Path | None:
    """A side's own, empty, inductor cache (a first run's cold compile), unless --warm-cache."""
    if args.warm_cache:
        return None
    cache = work / "inductor" / label
    shutil.rmtree(cache, ignore_errors=True)
    return cache


def recipe(label: str, prepared: Path, work: Path, args, root: Path = ROOT, flags: tuple = ()) -> dict:
    """train-experts (every round and sync) + assemble on a copy of the prepared RUN."""
    run = work / f"recipe-{label}"
    shutil.rmtree(run, ignore_errors=True)
    shutil.copytree(prepared, run)
    log = work / f"recipe-{label}.log"
    rows = [timed(f"{label}: train-experts", ["train-experts", run, "--experts", f"1-{args.experts}", "--tokens",
                                              args.tokens, "--lr", "1e-3", "--shared", "attn", "--shared-lr-scale", "0.3",
                                              "--rounds", args.rounds, "--compile", args.compile, *flags, "--no-progress"],
                  root=root, log=log, cache=inductor_cache(work, label, args)),
            timed(f"{label}: assemble", ["assemble", run, "-o", work / f"{label}.gguf", "--experts", f"1-{args.experts}",
                                         "--quant", "q8_0"], root=root, log=log)]
    return {"side": f"recipe {label}", "run": run, "rows": rows}


def continued(prepared: Path, experts_run: Path, work: Path, args, compile: str) -> dict:
    """train-base --mode full for the experts' FLOPs (eval's FLOP-matched baseline) + its assemble."""
    from mfgguf.config import ModelConfig
    from mfgguf.eval.baselines.imported import matched_tokens
    from mfgguf.flops import continued_step_flops, module_flops
    from mfgguf.run import RunDir, read_module_meta

    rd = RunDir(experts_run)
    metas = [read_module_meta(rd, i) for i in range(1, args.experts + 1)]
    cfg = ModelConfig.from_dict(read_module_meta(rd, 0)["config"])
    step = int(metas[0]["train"]["batch_size"]) * cfg.ctx_len
    flops = sum(module_flops(m) for m in metas)
    tokens = matched_tokens(flops, continued_step_flops(cfg, "full").total, step)
    side = f"continued, compile {compile}"
    out, log = work / f"continued-{compile}", work / f"continued-{compile}.log"
    shutil.rmtree(out, ignore_errors=True)
    rows = [timed(f"{side}: train-base", ["train-base", prepared, "-o", out, "--mode", "full", "--tokens", tokens, "--lr",
                                         args.continued_lr, "--shards", ",".join(map(str, range(1, args.experts + 1))),
                                         "--compile", compile, "--no-progress"],
                  log=log, cache=inductor_cache(work, side, args)),
            timed(f"{side}: assemble", ["assemble", out, "-o", work / f"continued-{compile}.gguf", "--experts", "none",
                                        "--quant", "q8_0"], log=log)]
    return {"side": side, "run": out, "rows": rows, "tokens": tokens, "flops": flops}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--experts", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=65_536, help="each expert's training tokens (all rounds)")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--continued-lr", default="3e-4", help="continued pretraining's peak LR (eval's grid chose it)")
    ap.add_argument("--max-chars-per-domain", type=int, default=1_000_000)
    ap.add_argument("--before", help="also time the recipe as this git revision runs it")
    ap.add_argument("--in-process", action="store_true", help="train-experts --in-process (this checkout's recipe only)")
    ap.add_argument("--both", action="store_true", help="this checkout's recipe with a process per job (--processes)"
                    " and --in-process, one after the other")
    ap.add_argument("--compile", default="off", help="the recipe's train-experts --compile (off: as a user runs it)")
    ap.add_argument("--baselines", default="off,auto", help="continued pretraining's --compile, each timed; the ratio"
                    " takes the fastest (the alternative at its best)")
    ap.add_argument("--warm-cache", action="store_true", help="share inductor's cache (default: each side starts cold,"
                    " as a first run does)")
    ap.add_argument("--work", type=Path, default=ROOT / "bench-out" / "recipe")
    args = ap.parse_args()
    work = args.work.resolve()
    work.mkdir(parents=True, exist_ok=True)
    from mfgguf import machine

    cpu = machine.cpu()["model"]
    print(json.dumps({"cpu": cpu, "cores": os.cpu_count(), "experts": args.experts, "tokens": args.tokens,
                      "rounds": args.rounds}), flush=True)
    prepared, log = work / "prepared", work / "common.log"
    if not (prepared / "data" / "train.npy").is_file():
        shutil.rmtree(prepared, ignore_errors=True)
        timed("common: import-base", ["import-base", "smollm2", "--expert-ff", "768", "--out", prepared], log=log)
        timed("common: prepare", ["prepare", "study", "--out", prepared, "--experts", args.experts, "--max-chars-per-domain",
                                  args.max_chars_per_domain, "--test-frac", "0.02", "--no-progress"], log=log)
    sides = []
    if args.before:
        tree = work / "before-tree"
        if not tree.is_dir():
            subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(tree), args.before], check=True,
                           capture_output=True)
        sides.append(recipe(f"before-{args.before}", prepared, work, args, root=tree))
    if args.both:  # on one worker train-experts runs in-process by default: ask for the processes
        sides.append(recipe("now", prepared, work, args, flags=("--processes",)))
    if args.both or args.in_process:
        sides.append(recipe("now-in-process", prepared, work, args, flags=("--in-process",)))
    else:
        sides.append(recipe("now", prepared, work, args))
    recipes = len(sides)
    for mode in args.baselines.split(","):
        sides.append(continued(prepared, sides[recipes - 1]["run"], work, args, mode))
    walls = {}
    for s in sides:
        walls[s["side"]] = sum(r["wall_s"] for r in s["rows"])
        print(json.dumps({"side": s["side"], "wall_s": round(walls[s["side"]], 1),
                          "peak_rss_mb": max(r["peak_rss_mb"] for r in s["rows"]),
                          **{k: s[k] for k in ("tokens", "flops") if k in s}}), flush=True)
    best = min(sides[recipes:], key=lambda s: walls[s["side"]])["side"]
    for s in sides[:recipes]:
        print(json.dumps({"ratio": f"{s['side']} / fastest continued ({best})", "wall": round(walls[s["side"]] / walls[best], 3)}))
    if args.before:
        from mfgguf.run import RunDir, read_module_meta

        sha = [[read_module_meta(RunDir(s["run"]), i)["sha256"] for i in range(0, args.experts + 1)] for s in sides[:2]]
        print(json.dumps({"same_bytes": sha[0] == sha[1]}), flush=True)


if __name__ == "__main__":
    main()
