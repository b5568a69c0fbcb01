#!/usr/bin/env bash
# Expert width on the real base (docs/studies/real-base-levers.md, "Expert width, router tuning and the practitioner's
# baselines"): SmolLM2-135M-Instruct imported with a 192-, 384- and 768-unit seed (`--expert-ff`; the same
# function each time: anchor + seed = the base's 1,536 FFN units), four experts each (c, cpp, man, Python;
# 65,536 tokens), English held out of all training; the base trained further on the same data with the FLOPs
# of the 384-unit experts (continued pretraining of every parameter, and a peft LoRA; the LRs the study's
# grid chose); `tune-router` on the 384-unit MoE; the wide experts again at LR 1e-3. Every file q8_0, top-1,
# scored by llama.cpp on the same held-out split. About 130 minutes on 2 cores. Usage: bash width-real-base.sh OUT
set -euo pipefail
OUT=${1:-width-smol}
for W in 192 384 768; do
  R="$OUT/w$W"
  mfgguf import-base smollm2 --out "$R" --expert-ff "$W"
  mfgguf prepare study --out "$R" --experts 5 --max-chars-per-domain 3000000 --test-frac 0.02
  STATS=train; [ "$W" = 768 ] && STATS=pass          # as measured: the 768-unit experts' statistics by a pass
  for e in 1 2 4 5; do
    mfgguf train-expert "$R" --expert "$e" --tokens 65536 --eval-tokens 4096 --stats-from "$STATS"
  done
  mfgguf router-stats "$R" --experts 1,2,4,5
  mfgguf assemble "$R" -o "$R.gguf" --experts 1,2,4,5 --quant q8_0 --force
  mfgguf perplexity "$R.gguf" --run "$R" --json > "$R.ppl.json"
done
mfgguf assemble "$OUT/w192" -o "$OUT/base.gguf" --experts none --quant q8_0 --force
mfgguf perplexity "$OUT/base.gguf" --run "$OUT/w192" --json > "$OUT/base.ppl.json"
# the practitioner's alternatives with the 384-unit experts' FLOPs (4 x 65,536 x 597 MFLOP):
mfgguf train-base "$OUT/w192" -o "$OUT/full" --mode full --tokens 188416 --lr 3e-4 --shards 1,2,4,5
mfgguf train-base "$OUT/w192" -o "$OUT/lora" --mode lora --tokens 262144 --lr 3e-3 --shards 1,2,4,5
for b in full lora; do
  mfgguf assemble "$OUT/$b" -o "$OUT/$b.gguf" --experts none --quant q8_0 --force
  mfgguf perplexity "$OUT/$b.gguf" --run "$OUT/w192" --json > "$OUT/$b.ppl.json"
done
# router-only tuning of the 384-unit MoE: the default (1% of the experts' tokens), then 4% at a higher LR
mfgguf tune-router "$OUT/w384.gguf" --run "$OUT/w384" -o "$OUT/w384-tuned.gguf" --force
mfgguf tune-router "$OUT/w384.gguf" --run "$OUT/w384" -o "$OUT/w384-tuned2.gguf" --tokens 10240 --lr 3e-3 --force
for f in w384-tuned w384-tuned2; do
  mfgguf perplexity "$OUT/$f.gguf" --run "$OUT/w384" --json > "$OUT/$f.ppl.json"
done
# the wide experts again at LR 1e-3 (the preset's 2e-3 above), the same runs' base and data
for W in 384 768; do
  R="$OUT/w$W-lr1"
  rm -rf "$R" && cp -a "$OUT/w$W" "$R" && rm -rf "$R"/modules/expert_* "$R"/modules/router_stats.* "$R"/checkpoints
  for e in 5 1 2 4; do
    mfgguf train-expert "$R" --expert "$e" --tokens 65536 --eval-tokens 4096 --lr 1e-3
  done
  mfgguf router-stats "$R" --experts 1,2,4,5
  mfgguf assemble "$R" -o "$R.gguf" --experts 1,2,4,5 --quant q8_0 --force
  mfgguf perplexity "$R.gguf" --run "$R" --json > "$R.ppl.json"
done
