#!/bin/bash
# Which pooled second moment routes best. For each RUN (experts trained, module format 1 = a second
# moment per expert), evaluate the router from the experts' own moments, then from `mfgguf router-stats`
# (trunk + each expert; a quarter of the tokens; the trunk alone).
# usage: bash docs/results/router-stats-study.sh RUN OUT
set -euo pipefail
RUN=$1; OUT=$2; M=${M:-mfgguf}
ev() { $M eval "$1" --routers ridge --top-k 1,2 --baselines none --quants "" | tail -1; }
go() { # name router-stats-args...
  local d=$OUT/$1; shift
  rm -rf "$d"; cp -a "$RUN" "$d"; rm -rf "$d/eval" "$d/checkpoints" "$d/modules/router_stats."*
  if [ "$#" -gt 0 ] || [ ! -f "$d/modules/router_stats.json" ]; then $M router-stats "$d" --no-progress "$@"; fi
  ev "$d"
}
mkdir -p "$OUT"
d=$OUT/format1; rm -rf "$d"; cp -a "$RUN" "$d"; rm -rf "$d/eval" "$d/checkpoints" "$d/modules/router_stats."*; ev "$d"
go experts --source experts
go experts64k --tokens 65536
go trunk --source trunk --tokens 262144  # the default when the table was measured (now 16,384)
