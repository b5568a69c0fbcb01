#!/usr/bin/env bash
# Per-domain LoRA adapters served by llama.cpp (the client picks its domain's adapter) against the MoE
# on SmolLM2-135M-Instruct (docs/studies/real-base-levers.md, "Per-domain LoRAs served by llama.cpp"): four label experts of
# 65,536 tokens on the study corpus (c, cpp, man, python; english held out of all training), `eval`
# for the MoE, the base and oracle routing, then one LoRA per expert's shard for that expert's FLOPs,
# its peak LR chosen among two on validation, scored once on test. Usage: bash domain-lora-study.sh OUT
set -euo pipefail
OUT=${1:-study-domain-lora}
[ -f "$OUT/run/modules/trunk.json" ] || mfgguf import-base smollm2 --out "$OUT/run"
[ -f "$OUT/run/data/train.npy" ] || mfgguf prepare study --out "$OUT/run" --experts 5 \
  --max-chars-per-domain 3000000 --test-frac 0.02 --no-progress
for e in 1 2 4 5; do                                  # shard 3 is english: nothing trains on it
  [ -f "$OUT/run/modules/expert_00$e.json" ] || mfgguf train-expert "$OUT/run" --expert "$e" --tokens 65536 \
    --eval-tokens 4096 --no-progress
done
mfgguf eval "$OUT/run" --routers ridge --top-k 1,2 --quants "" --max-tokens 32768 --no-dense
python - "$OUT" <<'PY'
import json, sys
from pathlib import Path
from mfgguf.run import RunDir, read_module_meta
from mfgguf.eval.baselines.imported import train_domain_loras
from mfgguf.eval.domain_loras import measure_domain_loras
out = Path(sys.argv[1]); rd = RunDir(out / "run")
metas = {i: read_module_meta(rd, i) for i in (0, 1, 2, 4, 5)}
rep = json.loads((out / "run/eval/report.json").read_text())
base = out / "run/eval/models/trunk-f16.gguf"          # the trunk alone: the base's own FFN, f16
res = {}
for lr in (3e-3, 1e-2):                               # the LR chosen on validation, scored on test once
    ad = train_domain_loras(rd, metas, out / f"dl-{lr:g}", lr=lr)
    res[lr] = {"validation": measure_domain_loras(base, ad, rd, rep["domains"], max_tokens=32768, split="validation")}
    print(json.dumps({"lr": lr, "validation": res[lr]["validation"]["overall"]}), flush=True)
trained = lambda r: [v for v in r["domains"].values() if v["adapter"]]
best = min(res, key=lambda lr: sum(v["nll"] * v["n_tokens"] for v in trained(res[lr]["validation"]))
                                / sum(v["n_tokens"] for v in trained(res[lr]["validation"])))
ad = train_domain_loras(rd, metas, out / f"dl-{best:g}", lr=best)
test = measure_domain_loras(base, ad, rd, rep["domains"], max_tokens=32768, split="test")
(out / "domain_loras.json").write_text(json.dumps({"chosen_lr": best, "grid": {f"{k:g}": v["validation"]
                                                  for k, v in res.items()}, "test": test}, indent=1, default=str))
print(json.dumps({"chosen_lr": best, "test": test}, default=str))
PY
