#!/usr/bin/env bash
# The levers measured on the real base (docs/studies/speed.md: the router statistics from training's last steps,
# `--expert-layers upper` at equal wall-clock; docs/studies/routing.md: `extend --keep-routing`). SmolLM2-135M-Instruct,
# the study corpus, four experts (c, cpp, man, Python), English added later. About 60 minutes on 2 cores.
# Results: expert-levers-real-base.jsonl, ppl-expert-levers-real-base.png. Usage: bash expert-levers-real-base.sh OUT
set -euo pipefail
OUT=${1:-levers-smol}
mfgguf import-base smollm2 --out "$OUT/run"
mfgguf prepare study --out "$OUT/run" --experts 5 --max-chars-per-domain 3000000 --test-frac 0.02
cp -a "$OUT/run" "$OUT/runup"                         # the same data and base, for the upper-half experts
for e in 1 2 4 5; do
  mfgguf train-expert "$OUT/run" --expert "$e" --tokens 65536 --eval-tokens 4096            # statistics from the last steps
  mfgguf train-expert "$OUT/runup" --expert "$e" --tokens 86016 --eval-tokens 4096 --expert-layers upper  # same wall-clock
done
python scripts/bench/bench_stats_tokens.py "$OUT/run" --tokens 16384 --max-tokens-per-domain 8192   # recorded vs a pass
for d in run runup; do
  mfgguf assemble "$OUT/$d" -o "$OUT/$d.gguf" --experts 1,2,4,5 --quant q8_0 --force
  mfgguf perplexity "$OUT/$d.gguf" --run "$OUT/$d" --json
done
mfgguf assemble "$OUT/run" -o "$OUT/base.gguf" --experts none --quant q8_0 --force
mfgguf perplexity "$OUT/base.gguf" --run "$OUT/run" --json
mfgguf train-expert "$OUT/run" --expert 3 --tokens 65536 --eval-tokens 4096                  # English, later
mfgguf extend "$OUT/run.gguf" --add "$OUT/run" --experts 3 -o "$OUT/moe5.gguf" --force
mfgguf extend "$OUT/run.gguf" --add "$OUT/run" --experts 3 -o "$OUT/moe5k.gguf" --force --keep-routing
mfgguf perplexity "$OUT/moe5.gguf" --run "$OUT/run" --json
mfgguf perplexity "$OUT/moe5k.gguf" --run "$OUT/run" --json
