#!/usr/bin/env bash
# How many tokens `router-stats --source trunk` needs on an imported base (docs/studies/speed.md, "Around the step"):
# the four 768-unit experts of width-real-base.sh, routed by the trunk alone's second moment over K tokens of the
# training mix, assembled q8_0 top-1 and scored by llama.cpp on the whole held-out split. Each K on a hard-linked
# copy of the RUN (router-stats replaces its files, never writes into them). Usage: bash router-stats-trunk-real-base.sh OUT
set -euo pipefail
OUT=${1:-width-smol}
R="$OUT/w768-lr1"
for K in 16384 65536 262144; do
  C="$OUT/rts-$K"
  rm -rf "$C" && cp -al "$R" "$C" && rm -f "$C"/modules/router_stats.*
  /usr/bin/time -f "%e s %M KB" mfgguf router-stats "$C" --source trunk --tokens "$K"
  mfgguf assemble "$C" -o "$C.gguf" --experts 1,2,4,5 --quant q8_0 --force
  mfgguf perplexity "$C.gguf" --run "$C" --json > "$C.ppl.json"
done
