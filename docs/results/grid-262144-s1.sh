#!/usr/bin/env bash
# The 262,144-token point's LR grids on validation, seed 1 (docs/studies/protocol.md, "The second point"): one
# `train-base` per grid point, the training `mfgguf eval`'s grid runs, on protocol_study.py's template, for a
# sitting too short for the whole study. Budgets are the experts' FLOPs (7.31e14): 214 steps of continued
# pretraining, 299 of the LoRA, 4,096 tokens a step. Prints one JSON line a point and one for the base, scored
# the same way (grid-262144-s1.jsonl).
# Usage: bash grid-262144-s1.sh [STUDY]
set -euo pipefail
STUDY=${1:-protocol-study}
T=$STUDY/template
if [ ! -f "$T/run.json" ]; then  # the study's template: the same data, test split cf26bb46...
  mfgguf import-base smollm2 --out "$T" --expert-ff 768 --force
  mfgguf prepare study --out "$T" --experts 5 --partition label --max-chars-per-domain 4500000 \
    --test-frac 0.02 --valid-frac 0.05 --seed 0 --no-progress
fi
for point in "full 0.001 876544" "lora 0.01 1224704" "lora 0.003 1224704" "lora 0.001 1224704"; do
  set -- $point
  [ -f "$STUDY/grid-$1-lr$2/modules/trunk.json" ] || mfgguf train-base "$T" -o "$STUDY/grid-$1-lr$2" --mode "$1" \
    --tokens "$3" --lr "$2" --shards 1,2,4,5 --seed 1 --no-progress --force
done
python - "$STUDY" <<'PY'
import json, sys
from pathlib import Path
from mfgguf.machine import cpu
from mfgguf.run import RunDir, read_module_meta
from mfgguf.train.engine.loop import resolve_device, resolve_precision
from mfgguf.train.experts.base_score import base_validation_loss

TRAINED, EVAL_TOKENS = ("c", "cpp", "man", "python"), 4096  # train-base's validation tokens a domain


def row(loss: dict, **fields) -> str:
    return json.dumps({"tokens_a_domain": 262144, **fields, "split": "validation",
                       "loss": {d: round(v, 4) for d, v in loss.items()},
                       "mean_trained": round(sum(loss[d] for d in TRAINED) / len(TRAINED), 4), "cpu": cpu()})


# the base, scored as the first expert scores it (anchor + seed alone), at the grid points' own token count
template, dev = RunDir(Path(sys.argv[1]) / "template"), resolve_device("cpu")
print(row(base_validation_loss(template, read_module_meta(template, 0), EVAL_TOKENS, dev, resolve_precision("auto", dev)),
          mode="base", lr=None))
for f in sorted(Path(sys.argv[1]).glob("grid-*/modules/trunk.json")):
    m = json.loads(f.read_text())
    c = m["continued"]
    print(row(m["validation_loss"], seed=c["seed"], mode=c["mode"], lr=c["lr"], tokens=m["tokens_seen"], steps=m["steps"],
              train_s=round(m["train_s"], 1), wall_s=round(m["wall_s"], 1), startup_s=m.get("startup_s"),
              tokens_per_s=round(m["tokens_per_s"], 1)))
PY
