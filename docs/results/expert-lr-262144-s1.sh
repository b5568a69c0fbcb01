#!/usr/bin/env bash
# The experts' LR checked at the 262,144-token point, seed 1 (docs/studies/protocol.md, "The experts' LR at 262,144
# tokens a domain"): the recipe's 1e-3 was chosen at 65,536 tokens; here its two neighbours train the whole MoE
# again (four experts, four rounds of attention copies and syncs) from the study's template, and each MoE eval
# builds is scored on validation by llama.cpp beside the study run's own (scripts/studies/lever_study.py). Nothing reads
# test. Prints one JSON line a MoE and a summary a LR (expert-lr-262144-s1.jsonl). About 45 minutes a LR on 2 cores.
# Usage: bash expert-lr-262144-s1.sh [STUDY]   (after the study's 262,144-token, seed-1 run is in its study.jsonl)
set -euo pipefail
STUDY=${1:-protocol-study}
for lr in 2e-3 5e-4; do
  python scripts/studies/lever_study.py --study "$STUDY" --tokens 262144 --seed 1 --name "lr$lr" --lr "$lr" \
    --moes top1,top2,seed0.4-top2
done
