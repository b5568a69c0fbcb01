#!/usr/bin/env bash
# The 262,144-token point's LR grids on validation, seed 1 (docs/base-model.md, "The second point"): one
# `train-base` per grid point, the training `mfgguf eval`'s grid runs, on protocol_study.py's template, for a
# sitting too short for the whole study. Budgets are the experts' FLOPs (7.31e14): 214 steps of continued
# pretraining, 299 of the LoRA, 4,096 tokens a step. Prints one JSON line a point (grid-262144-s1.jsonl).
# Usage: bash grid-262144-s1.sh [STUDY]
set -euo pipefail
STUDY=${1:-protocol-study}
T=$STUDY/template
if [ ! -f "$T/run.json" ]; then  # the study's template: the same data, test split cf26bb46...
  mfgguf import-base smollm2 --out "$T" --expert-ff 768 --force
  mfgguf prepare study --out "$T" --experts 5 --partition label --max-chars-per-domain 4500000 \
    --heldout-frac 0.02 --valid-frac 0.05 --seed 0 --no-progress
fi
for point in "full 0.001 876544" "lora 0.003 1224704" "lora 0.001 1224704"; do
  set -- $point
  [ -f "$STUDY/grid-$1-lr$2/modules/trunk.json" ] || mfgguf train-base "$T" -o "$STUDY/grid-$1-lr$2" --mode "$1" \
    --tokens "$3" --lr "$2" --shards 1,2,4,5 --seed 1 --no-progress --force
done
python - "$STUDY" <<'PY'
import json, sys
from pathlib import Path
from mfgguf.machine import cpu

for f in sorted(Path(sys.argv[1]).glob("grid-*/modules/trunk.json")):
    m = json.loads(f.read_text())
    c, loss = m["continued"], m["heldout_loss"]
    print(json.dumps({"tokens_a_domain": 262144, "seed": c["seed"], "mode": c["mode"], "lr": c["lr"],
                      "tokens": m["tokens_seen"], "steps": m["tokens_seen"] // 4096, "split": "validation",
                      "loss": {d: round(v, 4) for d, v in loss.items()},
                      "mean_trained": round(sum(loss[d] for d in ("c", "cpp", "man", "python")) / 4, 4),
                      "train_s": round(m["train_s"], 1), "wall_s": round(m["wall_s"], 1),
                      "startup_s": m.get("startup_s"), "tokens_per_s": round(m["tokens_per_s"], 1), "cpu": cpu()}))
PY
