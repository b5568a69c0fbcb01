#!/usr/bin/env bash
# The 262,144-token point's MoE, seed 1, trained on one machine and scored on validation only (docs/studies/protocol.md,
# "The second point"): the study's experts and syncs (`protocol_study.py --train-only`), the MoEs eval compares
# assembled under the names eval gives them (so its later run reuses them), each scored in PyTorch as the LR grid
# points were (eval/reference_validation.py: 4,096 validation tokens a domain), and the recipe's one-machine wall
# beside continued pretraining's on the same machine. Prints one JSON line a MoE and one for the walls
# (moe-262144-s1.jsonl).
# Usage: bash moe-262144-s1.sh [STUDY]   (after grid-262144-s1.sh, which made the template)
set -euo pipefail
STUDY=${1:-protocol-study}
python scripts/studies/protocol_study.py --out "$STUDY" --tokens 262144 --seeds 1 --max-chars-per-domain 4500000 \
  --max-tokens 16384 --seed-gates 0.4,0.6,0.8 --train-only
RUN=$STUDY/t262144-s1
M=$RUN/eval/models
mkdir -p "$M"
for k in 1 2; do
  for gate in "" 0.4 0.6 0.8; do
    f=$M/moe-ridge${gate:+-seed$gate}-top$k-f16.gguf
    [ -f "$f" ] || mfgguf assemble "$RUN" -o "$f" --quant f16 --router ridge --top-k $k --experts 1,2,4,5 \
      ${gate:+--seed-gate $gate} -q
  done
done
python - "$RUN" "$STUDY" <<'PY'
import json, sys
from pathlib import Path
from mfgguf.eval.baselines.imported import expert_walls
from mfgguf.eval.reference_validation import reference_validation
from mfgguf.machine import cpu
from mfgguf.run import RunDir, read_module_meta

TRAINED, EVAL_TOKENS = ("c", "cpp", "man", "python"), 4096  # the grid points' validation tokens a domain
rd = RunDir(Path(sys.argv[1]))
for f in sorted((rd.root / "eval" / "models").glob("moe-ridge*-f16.gguf")):
    loss = reference_validation(rd, f, EVAL_TOKENS)
    print(json.dumps({"tokens_a_domain": 262144, "seed": 1, "mode": "moe", "model": f.stem, "split": "validation",
                      "loss": {d: round(v, 4) for d, v in loss.items()},
                      "mean_trained": round(sum(loss[d] for d in TRAINED) / len(TRAINED), 4), "cpu": cpu()}), flush=True)
experts = {i: read_module_meta(rd, i) for i in (1, 2, 4, 5)}
walls, syncs = expert_walls(rd, experts)
# continued pretraining's wall: every grid point of it runs the same 214 steps, whatever its LR (the study's grid points
# are taken as trained on this machine, as grid-262144-s1.sh trains them; the JSONL of the grids names their CPU)
full = [read_module_meta(RunDir(p.parent.parent), 0) for p in Path(sys.argv[2]).glob("grid-full-*/modules/trunk.json")]
cpt = {m["continued"]["lr"]: round(float(m["wall_s"]) + float(m.get("startup_s") or 0.0), 1) for m in full}
print(json.dumps({"tokens_a_domain": 262144, "seed": 1, "mode": "walls", "moe_one_machine_s": round(sum(walls.values()) + syncs, 1),
                  "moe_critical_path_s": round(max(walls.values()) + syncs, 1), "syncs_s": round(syncs, 1),
                  "expert_walls_s": {str(i): round(w, 1) for i, w in walls.items()}, "cpt_wall_s_by_lr": cpt, "cpu": cpu()}))
PY
