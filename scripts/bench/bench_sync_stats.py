"""The final sync's router statistics: the last round's steps (the default) against a pass on the merged trunk.

After the last round of a recipe with shared copies, `sync` either takes the statistics the last
round's training steps recorded against each expert's own trunk copy (`--stats-from train`,
train/rounds/adopt.py: no pass) or measures them again with a forward pass of merged trunk + each
expert (`--stats-from pass`). This takes RUN, finished with the default, rebuilds the pass variant
from the experts as the final sync found them (RUN/rounds/sync_R/before), assembles both the same
way and scores both by llama.cpp on the validation split (never the test split), then prints JSON
lines: each variant's seconds of statistics, perplexity by domain and token-weighted overall, and
the ratio train / pass.

    python scripts/bench/bench_sync_stats.py bench-out/recipe/recipe-now --tokens 16384
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def pass_variant(src: Path, out: Path) -> float:
    """A copy of the finished RUN `src` whose experts' statistics come from the pass instead; its seconds."""
    from mfgguf.config import ModelConfig
    from mfgguf.run import RunDir, read_json, read_module_meta, update_manifest
    from mfgguf.train.experts.pooled import write_pooled
    from mfgguf.train.experts.stats import RouterStats
    from mfgguf.train.rounds.restat import restat

    shutil.rmtree(out, ignore_errors=True)
    shutil.copytree(src, out, ignore=shutil.ignore_patterns("checkpoints"))
    rd = RunDir(out)
    plan = sorted(rd.rounds.glob("sync_*/sync.json"))[-1]
    ids = read_json(plan, "the final sync's plan")["expert_ids"]
    for i in ids:  # the experts as the final sync found them; the trunk stays the merged one
        for f in (rd.module_file(i), rd.module_meta(i)):
            shutil.copy2(plan.parent / "before" / f.name, f)
        update_manifest(rd, i, read_json(rd.module_meta(i), "a module record"))
    t0 = time.perf_counter()
    cfg = ModelConfig.from_dict(read_module_meta(rd, 0)["config"])
    pooled = RouterStats(cfg.n_layers, cfg.dim, second_moment=True)  # G from the same passes, as `sync` pools it
    for i in ids:
        restat(rd.root, i, pooled=pooled)
    write_pooled(rd, pooled, t0=t0, experts=ids)
    return time.perf_counter() - t0


def main() -> None:
    from mfgguf.converters.assemble import assemble
    from mfgguf.run import RunDir, read_json, read_module_meta
    from mfgguf.runtime.perplexity import perplexity_by_domain

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run", type=Path, help="a RUN after its final `sync` with the default --stats-from train")
    ap.add_argument("--tokens", type=int, default=16_384, help="validation tokens scored a domain")
    ap.add_argument("--quant", default="q8_0")
    ap.add_argument("--top-k", type=int, default=2, help="experts a token (the recipe's: 2)")
    ap.add_argument("--work", type=Path, default=None, help="default: RUN-stats-pass beside RUN")
    args = ap.parse_args()
    rd = RunDir(args.run)
    ids = read_json(sorted(rd.rounds.glob("sync_*/sync.json"))[-1], "the final sync's plan")["expert_ids"]
    if any(read_module_meta(rd, i).get("router_stats_on") == "merged trunk" for i in ids):
        raise SystemExit(f"{rd.root}'s final sync ran the pass already; finish a RUN with the default `sync`")
    from mfgguf import machine

    cpu = machine.cpu()["model"]
    print(json.dumps({"cpu": cpu, "run": str(rd.root), "experts": ids, "tokens": args.tokens, "quant": args.quant,
                      "top_k": args.top_k}),
          flush=True)
    work = (args.work or rd.root.with_name(rd.root.name + "-stats-pass")).resolve()
    variants = {"train": (rd.root, None), "pass": (work, pass_variant(rd.root, work))}
    domains = rd.validation_tokens(args.tokens)
    overall = {}
    for name, (run, secs) in variants.items():
        gguf = run.parent / f"{run.name}-{name}.gguf"
        assemble(run, gguf, quant=args.quant, top_k=args.top_k, experts=ids, force=True, progress=False)
        r = perplexity_by_domain(gguf, domains)
        overall[name] = r["overall"]["ppl"]
        print(json.dumps({"stats_from": name, "stats_s": None if secs is None else round(secs, 1),
                          "ppl": {d: round(v["ppl"], 4) for d, v in r["domains"].items()},
                          "overall": round(r["overall"]["ppl"], 4)}), flush=True)
    print(json.dumps({"ratio": "train / pass", "overall": round(overall["train"] / overall["pass"], 4)}), flush=True)


if __name__ == "__main__":
    main()
