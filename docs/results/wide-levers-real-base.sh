#!/usr/bin/env bash
# The levers on the 768-unit experts (docs/studies/real-base-levers.md, "Levers on the wide experts"), after
# width-real-base.sh OUT has run: top-2, oracle routing, `calibrate`, the fifth (English) expert added with
# `extend` (and a bias searched on it), one EM round of `relabel` (with its control: the same draw, labels kept), experts that
# complement the seed, the practitioner's baselines with the 768-unit experts' FLOPs, `extend --guard`, and a
# third LR for the experts (and each expert at its best of the three). Every file q8_0,
# scored by llama.cpp on the same held-out split. About 4 hours on 2 cores. Usage: bash wide-levers-real-base.sh OUT
set -euo pipefail
OUT=${1:-width-smol}
R="$OUT/w768-lr1"
score() { mfgguf perplexity "$1" --run "$2" --json > "${1%.gguf}.ppl.json"; }
moe() {  # RUN -> RUN.gguf (the four experts, q8_0, top-1), scored
  mfgguf router-stats "$1" --experts 1,2,4,5
  mfgguf assemble "$1" -o "$1.gguf" --experts 1,2,4,5 --quant q8_0 --force
  score "$1.gguf" "$1"
}
train4() {  # RUN LR: the four label experts, 65,536 tokens each
  for e in 1 2 4 5; do mfgguf train-expert "$1" --expert "$e" --tokens 65536 --eval-tokens 4096 --lr "$2"; done
}
mfgguf assemble "$R" -o "$OUT/w768-top2.gguf" --experts 1,2,4,5 --quant q8_0 --top-k 2 --force
score "$OUT/w768-top2.gguf" "$R"
for e in 1 2 4 5; do                      # oracle routing: each domain through trunk + its own expert alone
  mfgguf assemble "$R" -o "$OUT/w768-only$e.gguf" --experts "$e" --quant q8_0 --force
  score "$OUT/w768-only$e.gguf" "$R"
done
mfgguf calibrate "$R.gguf" --run "$R" -o "$OUT/w768-cal.gguf" --force
score "$OUT/w768-cal.gguf" "$R"
# the held-out domain's expert, added to the finished four-expert file
mfgguf train-expert "$R" --expert 3 --tokens 65536 --eval-tokens 4096 --lr 1e-3
mfgguf extend "$R.gguf" --add "$R" --experts 3 -o "$OUT/w768-ext.gguf" --force
mfgguf extend "$R.gguf" --add "$R" --experts 3 -o "$OUT/w768-extk.gguf" --force --keep-routing
score "$OUT/w768-ext.gguf" "$R"
score "$OUT/w768-extk.gguf" "$R"
# a per-expert bias searched on the extended file (does it keep the old domains where they were?)
mfgguf calibrate "$OUT/w768-ext.gguf" --run "$R" -o "$OUT/w768-ext-bias.gguf" --top-k 1 --bias=-1,-0.5,0.5 --force
score "$OUT/w768-ext-bias.gguf" "$R"
# the old rows kept and the new one lowered until no old expert's training shard moves by more than 0.5%
mfgguf extend "$R.gguf" --add "$R" --experts 3 -o "$OUT/w768-extg.gguf" --force --guard 0.5
score "$OUT/w768-extg.gguf" "$R"
# one EM round: the experts choose their documents from a draw of 4 x their training tokens per shard
mfgguf relabel "$R" -o "$OUT/w768-em" --experts 1,2,4,5 --prefix 256 --tokens 262144 --force
mfgguf relabel "$R" -o "$OUT/w768-ctl" --experts 1,2,4,5 --tokens 262144 --keep-labels --force
for X in w768-em w768-ctl; do
  train4 "$OUT/$X" 1e-3
  moe "$OUT/$X"
done
# the practitioner's alternatives with the 768-unit experts' FLOPs (4 x 65,536 x 637.4 MFLOP = 1.671e14)
mfgguf train-base "$OUT/w192" -o "$OUT/full768" --mode full --tokens 200704 --lr 3e-4 --shards 1,2,4,5 --force
mfgguf train-base "$OUT/w192" -o "$OUT/lora768" --mode lora --tokens 278528 --lr 3e-3 --shards 1,2,4,5 --force
for b in full768 lora768; do
  mfgguf assemble "$OUT/$b" -o "$OUT/$b.gguf" --experts none --quant q8_0 --force
  score "$OUT/$b.gguf" "$OUT/w192"
done
# experts that complement the seed (a two-way MoE with it while training; the seed is expert 0 of the file, top-2)
C="$OUT/w768-c"
rm -rf "$C" && cp -a "$R" "$C" && rm -rf "$C"/modules/expert_* "$C"/modules/router_stats.* "$C"/checkpoints
for e in 1 2 4 5; do
  mfgguf train-expert "$C" --expert "$e" --tokens 65536 --eval-tokens 4096 --lr 1e-3 --complement
done
mfgguf router-stats "$C" --experts 1,2,4,5
for r in learned ridge ridge+learned; do
  mfgguf assemble "$C" -o "$OUT/w768-c-$r.gguf" --experts 1,2,4,5 --quant q8_0 --top-k 2 --router "$r" --force
  score "$OUT/w768-c-$r.gguf" "$C"
done
# an LR grid for the experts, as the baselines had: a third point, 5e-4 (2e-3 and 1e-3 ran in width-real-base.sh)
L="$OUT/w768-lr05"
rm -rf "$L" && cp -a "$R" "$L" && rm -rf "$L"/modules/expert_* "$L"/modules/router_stats.* "$L"/checkpoints
train4 "$L" 5e-4
moe "$L"
# each expert at the LR of the three with its best own-domain held-out loss: c 1e-3, cpp and man 2e-3, Python 5e-4
M="$OUT/w768-mix"
rm -rf "$M" && cp -a "$R" "$M" && rm -rf "$M"/modules/router_stats.* "$M"/checkpoints
for f in "$OUT"/w768/modules/expert_00[24].* "$L"/modules/expert_005.*; do cp -a "$f" "$M/modules/"; done
python -c "
import sys
from mfgguf.run import RunDir, read_module_meta, update_manifest
rd = RunDir(sys.argv[1])
for i in (2, 4, 5): update_manifest(rd, i, read_module_meta(rd, i))
" "$M"
moe "$M"
