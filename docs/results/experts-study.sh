#!/bin/bash
# The "number of experts" rows of docs/results/README.md: FFN-only experts from the seed (R=1, no communication), the
# same seeded trunk for every N, the built-in corpus re-partitioned into N clusters.
#   bash docs/results/experts-study.sh TRUNK_RUN OUT     (TRUNK_RUN: the seed study's trunk, see seed-study.sh)
# `prepare` with another --experts writes the same tokenizer, training tokens and held-out split (the
# partition only cuts the shards), so the trunk is copied rather than retrained; the script checks that.
set -euo pipefail
T=$1; OUT=$2; M=${MFGGUF:-mfgguf}; PY=${PYTHON:-python}
mkdir -p "$OUT"
install_trunk() {  # install_trunk RUN: the seeded trunk of $T into RUN (same data, checked)
  cmp -s "$T/data/train.npy" "$1/data/train.npy" && cmp -s "$T/tokenizer.json" "$1/tokenizer.json" \
    || { echo "$1 does not hold $T's training tokens; prepare it with the same sources and --max-chars-per-domain" >&2; exit 1; }
  mkdir -p "$1/modules"; cp "$T/modules/trunk.safetensors" "$T/modules/trunk.json" "$1/modules/"
  $PY -c "import json,sys; from mfgguf.run import RunDir, update_manifest; rd=RunDir(sys.argv[1]); update_manifest(rd, 0, json.loads(rd.module_meta(0).read_text()))" "$1"
}
row() {  # row NAME N TOKENS_PER_EXPERT BASELINES   (ONLY="a b": run just those rows; TOPK=1,2: the top-2 row)
  if [ -n "${ONLY:-}" ] && [[ " $ONLY " != *" $1 "* ]]; then return; fi
  local p="$OUT/prep$2" d="$OUT/$1"
  [ -d "$p" ] || { $M prepare builtin --out "$p" --experts "$2" --partition cluster --max-chars-per-domain 3000000 --no-progress; install_trunk "$p"; }
  rm -rf "$d"; cp -a "$p" "$d"
  $M train-experts "$d" --workers 1 --shared none --tokens "$3" --no-progress
  $M eval "$d" --routers ridge,centroid --top-k "${TOPK:-1}" --baselines "$4" --quants q8_0
}
row n6    6  200000 flop,wallclock   # 6 clusters, 200k tokens each: the 3 x 400k label row's total, half its critical path
row n12  12  100000 wallclock        # 12 clusters, 100k tokens each: the same total again
row n12b 12  200000 wallclock        # 12 clusters, 200k tokens each: the 6-expert row's critical path, twice its total
