"""Experts a token chosen at run time on one MoE file: decode speed and test perplexity at each K.

The file is not rewritten: each K is llama.cpp's metadata override (`--experts-per-token K`, what llama.cpp's own
programs take as `--override-kv ARCH.expert_used_count=int:K`). Decode and prompt speed come from
scripts/bench/bench_decode.py's interleaved rounds (each K in its own process, the order turning each round; the figure
is the median of each round's ratio to the first K); test perplexity from `mfgguf perplexity --run RUN
--experts-per-token K` (llama.cpp, each domain's first --chunks windows), once per K.

Prints JSON lines and appends them to OUT/bench_experts_per_token.jsonl (the decode rounds to OUT/bench_decode.jsonl).

    python scripts/bench/bench_experts_per_token.py n100/bench/moe-q8_0.gguf --run n100/run --ks 1,2,4,8 --rounds 5
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path[:0] = [str(ROOT / "scripts" / "bench"), str(ROOT / "scripts" / "studies"), str(ROOT / "scripts")]


def emit(out: Path, **rec) -> dict:
    print(json.dumps(rec), flush=True)
    with open(out / "bench_experts_per_token.jsonl", "a") as f:
        f.write(json.dumps(rec) + "\n")
    return rec


def main(argv=None) -> None:
    import bench_decode
    from bench_train import cpu_flags

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", type=Path)
    ap.add_argument("--run", type=Path, required=True, help="the RUN whose test split is scored")
    ap.add_argument("--ks", default="1,2,4,8")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--chunks", type=int, default=4, help="perplexity: each domain's first N windows")
    ap.add_argument("--out", type=Path, default=ROOT / "bench-out" / "experts-per-token")
    a = ap.parse_args(argv)
    a.out.mkdir(parents=True, exist_ok=True)
    ks = [int(k) for k in a.ks.split(",")]
    emit(a.out, bench="cpu", file=a.model.name, **cpu_flags())
    for k in ks:
        cmd = [sys.executable, "-m", "mfgguf", "perplexity", str(a.model), "--run", str(a.run), "--chunks", str(a.chunks),
               "--experts-per-token", str(k), "--json"]
        r = json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True, cwd=ROOT).stdout)
        emit(a.out, bench="perplexity", experts_per_token=k, ppl=r["overall"]["ppl"], scored_tokens=r["overall"]["n_tokens"],
             domains={d: v["ppl"] for d, v in r["domains"].items()})
    bench_decode.main([f"k{k}={a.model}@{k}" for k in ks] + ["--rounds", str(a.rounds), "--out", str(a.out)])


if __name__ == "__main__":
    main()
