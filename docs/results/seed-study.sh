#!/bin/bash
# The "seed FFN" table of docs/results/README.md: one trunk trained with --seed-expert, 3 experts per row, each row a copy.
#   mfgguf prepare builtin --out RUN --experts 3 --max-chars-per-domain 3000000
#   mfgguf train-trunk RUN --preset small --seed-expert
#   bash docs/results/seed-study.sh RUN OUT
set -euo pipefail
RUN=$1; OUT=$2; M=${MFGGUF:-mfgguf}
mkdir -p "$OUT"
ev() {  # rows with the same FLOP budget share the dense baselines (trained once, by the first)
  if [ -d "$OUT/all/eval/dense-flop" ] && [ "$1" != "$OUT/all" ]; then mkdir -p "$1/eval"; cp -an "$OUT/all/eval/dense-flop" "$OUT/all/eval/dense-wallclock" "$1/eval/"; fi
  $M eval "$1" --routers ridge,centroid --top-k 1 --baselines "$2" --quants q8_0
}
row() {  # row NAME SHARED SCALE ROUNDS BASELINES [train-experts flags...]   (ONLY="a b": run just those rows)
  if [ -n "${ONLY:-}" ] && [[ " $ONLY " != *" $1 "* ]]; then return; fi
  local d="$OUT/$1"
  rm -rf "$d"; cp -a "$RUN" "$d"; rm -rf "$d/eval" "$d/checkpoints" "$d/rounds"
  $M train-experts "$d" --workers 1 --shared "$2" --shared-lr-scale "$3" --rounds "$4" --no-progress "${@:6}"
  ev "$d" "$5"
}
row all  all  1.0 1 flop,wallclock   # experts start from the seed, train a full trunk copy, one final sync
row r4   all  1.0 4 flop,wallclock   # the same with 4 sync rounds (the demo's configuration)
row ffn  none 1.0 1 none             # FFN-only experts from the seed (a smaller FLOP budget: no baselines)
row s01r4 all 0.1 4 flop,wallclock   # copies at 0.1x the LR (the trunk's final LR), 4 rounds
row r8   all  1.0 8 flop,wallclock   # 8 sync rounds
row r4n  all  1.0 4 flop,wallclock --outer-lr 0.7 --outer-momentum 0.9   # R=4, DiLoCo's outer Nesterov step at each sync
