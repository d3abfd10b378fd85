#!/usr/bin/env bash
# Batch 1's forward (1-token bucket, one sequence of 256 keys) by graph replay for forward_levers.py
# variants, once per model named in MODELS (default: 1B and 8B; the card is named first), the plan
# first and last so drift shows.
# Usage, on the GPU host: [MODELS="llama-3.2-1b llama-3.1-8b"] bash bench/plan_sweep.sh OUT_DIR variant ...
set -uo pipefail
out=${1:?OUT_DIR}; shift
source bench/device_tree.sh
variants=$(IFS=,; echo "prod,$*,prod")
for model in ${MODELS:-llama-3.2-1b llama-3.1-8b}; do
  timeout 280 python3 bench/forward_levers.py --model "$model" --buckets 1 --decodes 1 --variants "$variants" \
    --profile none --out "$out/$model" 2>&1 | grep -v -i warn | grep -A40 "^## "
done
