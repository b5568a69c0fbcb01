#!/bin/bash
# The shared-trunk table of docs/results/README.md: one trained trunk, 3 experts per row, each row a copy of RUN.
#   mfgguf prepare builtin --out RUN --experts 3 --max-chars-per-domain 3000000
#   mfgguf train-trunk RUN --preset small
#   bash docs/results/sync-study.sh RUN OUT
set -euo pipefail
RUN=$1; OUT=$2; M=${MFGGUF:-mfgguf}
mkdir -p "$OUT"
ev() {  # the same dense baselines for every row with the same budget: trained once, then reused
  if [ -d "$OUT/all/eval/dense-flop" ] && [ "$1" != "$OUT/all" ]; then mkdir -p "$1/eval"; cp -an "$OUT/all/eval/dense-flop" "$OUT/all/eval/dense-wallclock" "$1/eval/"; fi
  $M eval "$1" --routers ridge,centroid --top-k 1,2 --baselines flop,wallclock --quants q8_0
}
row() {  # row NAME SHARED SCALE ROUNDS SYNC(yes|no)
  local d="$OUT/$1"
  rm -rf "$d"; cp -a "$RUN" "$d"; rm -rf "$d/eval" "$d/checkpoints" "$d/rounds"
  for r in $(seq 1 "$4"); do
    for i in 1 2 3; do $M train-expert "$d" --expert $i --shared "$2" --shared-lr-scale "$3" --rounds "$4" --no-progress; done
    if [ "$5" = yes ]; then $M sync "$d" --no-progress; fi
  done
  ev "$d"
}
row all      all  1.0 1 no    # merged by assemble, statistics from the private copies
cp -a "$OUT/all" "$OUT/all_sync"; rm -rf "$OUT/all_sync/eval"; $M sync "$OUT/all_sync" --no-progress; ev "$OUT/all_sync"
row r2       all  1.0 2 yes
row r4       all  1.0 4 yes
row s01      all  0.1 1 yes
row r4s01    all  0.1 4 yes
row r8       all  1.0 8 yes
row ffn      none 1.0 1 no    # FFN-only experts
