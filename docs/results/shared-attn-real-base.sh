#!/usr/bin/env bash
# Experts that adapt attention too (docs/studies/real-base-levers.md, "Experts that adapt attention too"), after
# width-real-base.sh and wide-levers-real-base.sh OUT have run: the four 768-unit experts (c, cpp, man, Python;
# LR 1e-3, 65,536 tokens) each also train a private copy of every layer's attention and norms
# (`--shared attn`) at the expert's LR x 0.3 or x 1.0, merged into one trunk by 4 sync rounds; English sits out
# of every sync (held out of all training). The practitioner's baselines again with these experts' FLOPs
# (4 x 65,536 x 697.3 MFLOP = 1.828e14). Every file q8_0, scored by llama.cpp on the same held-out split.
# About 80 minutes on 2 cores. Usage: bash shared-attn-real-base.sh OUT
set -euo pipefail
OUT=${1:-width-smol}
score() { mfgguf perplexity "$1" --run "$2" --json > "${1%.gguf}.ppl.json"; }
for SCALE in 0.3 1.0; do
  S="$OUT/w768-attn$SCALE"
  rm -rf "$S" && cp -a "$OUT/w768-lr1" "$S" && rm -rf "$S"/modules/expert_* "$S"/modules/router_stats.* "$S"/checkpoints "$S"/rounds
  for r in 1 2 3 4; do
    for e in 1 2 4 5; do
      mfgguf train-expert "$S" --expert "$e" --tokens 65536 --eval-tokens 4096 --lr 1e-3 \
        --shared attn --shared-lr-scale "$SCALE" --rounds 4
    done
    mfgguf sync "$S" --experts 1,2,4,5     # the last one also recomputes the router statistics on the merged trunk
  done
  mfgguf assemble "$S" -o "$S.gguf" --experts 1,2,4,5 --quant q8_0 --force
  score "$S.gguf" "$S"
  mfgguf assemble "$S" -o "$S-top2.gguf" --experts 1,2,4,5 --quant q8_0 --top-k 2 --force
  score "$S-top2.gguf" "$S"
done
# the practitioner's alternatives with these experts' FLOPs
mfgguf train-base "$OUT/w192" -o "$OUT/full-attn" --mode full --tokens 221184 --lr 3e-4 --shards 1,2,4,5 --force
mfgguf train-base "$OUT/w192" -o "$OUT/lora-attn" --mode lora --tokens 307200 --lr 3e-3 --shards 1,2,4,5 --force
for b in full-attn lora-attn; do
  mfgguf assemble "$OUT/$b" -o "$OUT/$b.gguf" --experts none --quant q8_0 --force
  score "$OUT/$b.gguf" "$OUT/w192"
done
