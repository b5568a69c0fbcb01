"""The 1.15B of a hundred trained experts: its files, memory, speed and held-out perplexity against the base.

Takes a RUN of an imported base whose experts are all trained (`train-experts`), for example the
design card's 100 x 10M-parameter experts on SmolLM2 over `prepare --partition cluster --experts 100`,
and measures, each stage in its own process (peak RSS by wait4):

  - the cluster partition: tokens and documents a cluster, its purity (largest domain's share);
  - `assemble` at q8_0 and q4_k (wall, peak RSS, file size) and the base alone (`--experts none`, q8_0);
  - llama-cpp-python on each file: load, prompt and greedy decode speed, peak RSS (bench_scale.INFER);
  - `perplexity --run RUN` of the base and of each MoE on the test split (llama.cpp; `--chunks` to cap);
  - `inspect`'s total and active parameters.

Prints JSON lines and appends them to OUT/bench_hundred_trained.jsonl.

    python scripts/bench/bench_hundred_trained.py RUN --out OUT
    python scripts/bench/bench_hundred_trained.py RUN --out OUT --chunks 4     # a quick perplexity
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
    with open(out / "bench_hundred_trained.jsonl", "a") as f:
        f.write(json.dumps(rec) + "\n")
    return rec


def partition(run: Path) -> dict:
    """Balance and purity of the run's shards (run.json)."""
    shards = json.loads((run / "run.json").read_text())["shards"]
    tokens = [s["tokens"] for s in shards]
    purity = [max(s["domains"].values()) / s["tokens"] for s in shards]
    return {"clusters": len(shards), "tokens_min": min(tokens), "tokens_median": statistics.median(tokens),
            "tokens_max": max(tokens), "docs_min": min(s["docs"] for s in shards),
            "docs_max": max(s["docs"] for s in shards), "purity_mean": round(statistics.fmean(purity), 3),
            "clusters_95_pure": sum(p >= 0.95 for p in purity)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run", type=Path)
    ap.add_argument("--out", type=Path, default=ROOT / "bench-out" / "hundred-trained")
    ap.add_argument("--chunks", type=int, default=0, help="perplexity: each domain's first N windows (0: all)")
    a = ap.parse_args()

    from bench_train import cpu_flags

    from mfgguf.gguf.inspect import inspect_gguf
    from mfgguf.stages import run_stage

    out: Path = a.out
    out.mkdir(parents=True, exist_ok=True)
    emit(out, bench="cpu", **cpu_flags())
    emit(out, bench="partition", **partition(a.run))
    files = {"base_q8_0": (out / "base-q8_0.gguf", ["--experts", "none", "--quant", "q8_0"]),
             "moe_q8_0": (out / "moe-q8_0.gguf", ["--quant", "q8_0"]),
             "moe_q4_k": (out / "moe-q4_k.gguf", ["--quant", "q4_k"])}
    for name, (path, args) in files.items():
        r, _ = run_stage(f"assemble {name}", ["assemble", a.run, "-o", path, *args, "--force", "-q"])
        emit(out, bench="assemble", model=name, wall_s=r.wall_s, peak_rss_mb=r.peak_rss_mb,
             file_gib=round(path.stat().st_size / 2**30, 3))
    info = inspect_gguf(files["moe_q8_0"][0])  # what `mfgguf inspect` prints
    emit(out, bench="inspect", params_total=info["params_total"], params_active=info["params_active"],
         n_experts=info["n_experts"], top_k=info["top_k"])
    speed = {}
    for name, (path, _) in files.items():
        r, text = run_stage(f"infer {name}", [sys.executable, "-c", INFER, str(path), "256", "128",
                                               str(ROOT / "README.md")], capture=True)
        speed[name] = json.loads(text.strip().splitlines()[-1])
        emit(out, bench="inference", model=name, peak_rss_mb=r.peak_rss_mb, **speed[name])
    for name in ("moe_q8_0", "moe_q4_k"):
        emit(out, bench="vs_base", model=name, decode=round(speed[name]["decode_tps"] / speed["base_q8_0"]["decode_tps"], 3),
             prompt=round(speed[name]["prompt_tps"] / speed["base_q8_0"]["prompt_tps"], 3))
    ppl = {}
    for name, (path, _) in files.items():
        chunks = ["--chunks", str(a.chunks)] if a.chunks else []
        r, text = run_stage(f"perplexity {name}", ["perplexity", path, "--run", a.run, "--json", *chunks], capture=True)
        ppl[name] = json.loads(text[text.index("{"):])
        emit(out, bench="perplexity", model=name, wall_s=r.wall_s, overall=round(ppl[name]["overall"]["ppl"], 4),
             scored_tokens=ppl[name]["overall"]["n_tokens"],
             domains={d: round(v["ppl"], 4) for d, v in ppl[name]["domains"].items()})
    for name in ("moe_q8_0", "moe_q4_k"):
        emit(out, bench="perplexity_vs_base", model=name,
             overall=round(ppl[name]["overall"]["ppl"] / ppl["base_q8_0"]["overall"]["ppl"], 4),
             domains={d: round(v["ppl"] / ppl["base_q8_0"]["domains"][d]["ppl"], 4) for d, v in ppl[name]["domains"].items()})


if __name__ == "__main__":
    main()
