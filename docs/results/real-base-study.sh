#!/usr/bin/env bash
# The real-base study (docs/studies/real-base-levers.md, "Experts against continued pretraining and LoRA"):
# SmolLM2-135M-Instruct, four label experts on the study corpus (c, cpp, man, python), english held
# out of all training (the forgetting domain), `mfgguf eval` with the practitioner's baselines, then
# the fifth domain's expert added with `extend`. About 75 minutes on 2 cores. Usage: bash real-base-study.sh OUT
set -euo pipefail
OUT=${1:-study-smol}
mfgguf import-base smollm2 --out "$OUT/run"
mfgguf prepare study --out "$OUT/run" --experts 5 --max-chars-per-domain 3000000 --test-frac 0.02
for e in 1 2 4 5; do                                  # shard 3 is english: no expert, no baseline trains on it
  mfgguf train-expert "$OUT/run" --expert "$e" --tokens 65536 --eval-tokens 4096 --stats-from pass
done                                                  # (the study's statistics: a pass after training)
mfgguf router-stats "$OUT/run" --experts 1,2,4,5
python scripts/bench/bench_stats_tokens.py "$OUT/run" --tokens 1024,4096,16384 --out "$OUT/stats-tokens" \
  --max-tokens-per-domain 8192                        # router quality against statistics tokens
mfgguf eval "$OUT/run" --routers ridge --top-k 1,2 --quants "" --max-tokens 32768   # MoE, base, continued, LoRA
# the fifth domain later: its expert joins the finished file
mfgguf assemble "$OUT/run" -o "$OUT/moe4.gguf" --experts 1,2,4,5 --quant q8_0 --force
mfgguf train-expert "$OUT/run" --expert 3 --tokens 65536 --eval-tokens 4096 --stats-from pass
mfgguf extend "$OUT/moe4.gguf" --add "$OUT/run" --experts 3 -o "$OUT/moe5.gguf" --force
mfgguf perplexity "$OUT/moe4.gguf" --run "$OUT/run"
mfgguf perplexity "$OUT/moe5.gguf" --run "$OUT/run"
