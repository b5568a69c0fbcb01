"""`mfgguf perplexity` against llama.cpp's own `llama-perplexity` on one file and one text, interleaved rounds.

Both score the same windows (`--ctx`, the first `--chunks` of them) on every core, each in its own process,
load included: the wall a user waits for. The figure is the median over rounds of each round's ratio of
llama-perplexity's wall to mfgguf's (above 1: mfgguf is faster), with its range; the perplexities are printed too,
since the two must agree (tests/runtime/test_llama_tools.py holds them to 0.1%). llama-perplexity comes from
`make llama-tools`.

Prints JSON lines and appends them to OUT/bench_perplexity.jsonl.

    python scripts/bench/bench_perplexity.py model.gguf --text test.txt --rounds 5 --out bench-out/perplexity
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path[:0] = [str(ROOT / "scripts" / "bench"), str(ROOT / "scripts" / "studies"), str(ROOT / "scripts")]


def emit(out: Path, **rec) -> dict:
    print(json.dumps(rec), flush=True)
    with open(out / "bench_perplexity.jsonl", "a") as f:
        f.write(json.dumps(rec) + "\n")
    return rec


def timed(argv: list[str]) -> tuple[float, str]:
    t0 = time.perf_counter()
    p = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, text=True, errors="replace")
    wall = time.perf_counter() - t0
    if p.returncode != 0:
        sys.exit(f"bench_perplexity: {Path(argv[0]).name} exited with {p.returncode}: {p.stderr.strip()[-500:]}")
    return wall, p.stdout + p.stderr


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", type=Path, help="a GGUF both programs score")
    ap.add_argument("--text", type=Path, required=True, help="a text file (at least ctx x chunks tokens)")
    ap.add_argument("--ctx", type=int, default=1024, help="the window, as both programs' -c / --ctx")
    ap.add_argument("--chunks", type=int, default=8, help="windows scored")
    ap.add_argument("--rounds", type=int, default=5, help="runs of each program, interleaved")
    ap.add_argument("--out", type=Path, default=ROOT / "bench-out" / "perplexity")
    a = ap.parse_args(argv)

    from bench_train import cpu_flags
    from build_llama_tools import pinned_version, tools_dir

    from mfgguf.runtime import repack
    from mfgguf.stages import mfgguf_argv

    theirs = tools_dir(pinned_version()) / "llama-perplexity"
    if not theirs.is_file():
        sys.exit("bench_perplexity: llama-perplexity is not built; run `make llama-tools`")
    a.out.mkdir(parents=True, exist_ok=True)
    emit(a.out, bench="cpu", **cpu_flags())
    no_repack = [] if repack.current().repack else ["--no-repack"]  # mfgguf's own policy, for both
    programs = {
        "llama-perplexity": [str(theirs), "-m", str(a.model), "-f", str(a.text), "-c", str(a.ctx), "--chunks",
                             str(a.chunks), "-t", str(os.cpu_count()), *no_repack],  # mfgguf's threads
        "mfgguf": [*map(str, mfgguf_argv("perplexity", a.model, "--data", a.text, "--ctx", a.ctx, "--chunks",
                                         a.chunks, "--json"))],
    }
    walls: dict[str, list[float]] = {k: [] for k in programs}
    for k in range(a.rounds):
        for name in (list(programs) if k % 2 == 0 else list(programs)[::-1]):  # each leads every other round
            wall, text = timed(programs[name])
            if name == "mfgguf":
                ppl = json.loads(text[text.index("{"):text.rindex("}") + 1])["overall"]["ppl"]
            else:
                ppl = float(re.search(r"Final estimate: PPL = ([0-9.]+)", text).group(1))
            walls[name].append(wall)
            emit(a.out, bench="run", round=k, program=name, wall_s=round(wall, 3), ppl=round(ppl, 4))
    ratios = [t / m for t, m in zip(walls["llama-perplexity"], walls["mfgguf"])]  # (rounds,) above 1: mfgguf faster
    emit(a.out, bench="against", model=str(a.model.name), ctx=a.ctx, chunks=a.chunks, threads=os.cpu_count(),
         rounds=a.rounds, llama_perplexity_over_mfgguf={"median": round(statistics.median(ratios), 3),
                                                         "min": round(min(ratios), 3), "max": round(max(ratios), 3)},
         wall_s_median={k: round(statistics.median(v), 2) for k, v in walls.items()})


if __name__ == "__main__":
    main()
