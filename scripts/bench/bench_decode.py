"""Decode and prompt speed of GGUF files against a reference file, repeated and interleaved.

One llama-cpp-python decode of 128 tokens moves by 10-20% between runs on a shared or throttling host, which is
as wide as the margins a goal like "the MoE decodes at >= 0.85x the base" asks about. So each round runs every file
once, each in its own process (bench_scale.INFER: load, a prompt, greedy decode), the order of the files turning
from round to round so that neither side always runs first; the figure is the median over rounds of each round's
ratio against the first file (the reference), which a drift slower than a round cancels out of, with its range.

Prints JSON lines and appends them to OUT/bench_decode.jsonl: a line per process run (tokens/s, peak RSS), then a
line per file against the reference (median, min and max of the rounds' ratios, decode and prompt).

    python scripts/bench/bench_decode.py base=base-q8_0.gguf moe=moe-q8_0.gguf --rounds 7 --out bench-out/decode
    python scripts/bench/bench_decode.py k1=moe.gguf@1 k2=moe.gguf@2 k4=moe.gguf@4   # experts a token set at run time
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path[:0] = [str(ROOT / "scripts" / "bench"), str(ROOT / "scripts" / "studies"), str(ROOT / "scripts")]

from bench_scale import INFER  # noqa: E402


def emit(out: Path, **rec) -> dict:
    print(json.dumps(rec), flush=True)
    with open(out / "bench_decode.jsonl", "a") as f:
        f.write(json.dumps(rec) + "\n")
    return rec


def named(text: str) -> tuple[str, Path, int]:
    """NAME=PATH[@K]: a file to time, under NAME, with K experts a token (0: the file's own count)."""
    name, _, path = text.rpartition("=")
    path, _, k = path.partition("@")
    return name or Path(path).stem, Path(path), int(k or 0)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("files", nargs="+", type=named, help="NAME=PATH[@K] of each GGUF (K: experts a token, the"
                    " file's own without it); the first is the reference")
    ap.add_argument("--rounds", type=int, default=7, help="runs of each file, interleaved")
    ap.add_argument("--prompt-tokens", type=int, default=256, help="tokens evaluated as one prompt before decoding")
    ap.add_argument("--decode-tokens", type=int, default=128, help="greedy decode steps, one token each")
    ap.add_argument("--out", type=Path, default=ROOT / "bench-out" / "decode")
    a = ap.parse_args(argv)

    from bench_train import cpu_flags

    from mfgguf.stages import run_stage

    a.out.mkdir(parents=True, exist_ok=True)
    emit(a.out, bench="cpu", **cpu_flags())
    runs: dict[str, list[dict]] = {name: [] for name, _, _ in a.files}
    for k in range(a.rounds):
        order = a.files[k % len(a.files):] + a.files[:k % len(a.files)]  # each file leads a round in turn
        for name, path, experts in order:
            r, text = run_stage(f"decode {name}", [sys.executable, "-c", INFER, str(path), str(a.prompt_tokens),
                                                    str(a.decode_tokens), str(ROOT / "README.md"), str(experts)],
                                capture=True)
            got = json.loads(text.strip().splitlines()[-1])
            runs[name].append(got)
            emit(a.out, bench="run", round=k, model=name, file_bytes=path.stat().st_size, peak_rss_mb=r.peak_rss_mb,
                 experts_per_token=experts or None, **got)
    ref = a.files[0][0]
    for name, _, _ in a.files[1:]:
        row = {"bench": "against", "model": name, "reference": ref, "rounds": a.rounds}
        for key in ("decode_tps", "prompt_tps"):
            ratios = [x[key] / y[key] for x, y in zip(runs[name], runs[ref])]  # (rounds,) each round's own ratio
            row[key.removesuffix("_tps")] = {"median": round(statistics.median(ratios), 3),
                                             "min": round(min(ratios), 3), "max": round(max(ratios), 3)}
            row[f"{key}_median"] = round(statistics.median(x[key] for x in runs[name]), 1)
        row["reference_decode_tps_median"] = round(statistics.median(y["decode_tps"] for y in runs[ref]), 1)
        emit(a.out, **row)


if __name__ == "__main__":
    main()
