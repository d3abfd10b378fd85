#!/usr/bin/env bash
# Batch 1 with the model-shaped launch plans (model/launch_plans.py) against the 1B-tuned plan they
# replace: the step by graph replay at 256 and 4096 keys (bench/forward_levers.py), then TPOT through
# HTTP at the shipped geometry (bench/http_sweep.py), for 1B and 8B. Usage: bash bench/b1_plans.sh OUT_DIR
set -uo pipefail
out=${1:?OUT_DIR}
old8=prod+qkv16.split_k=4+o16.split_k=4+down16.split_k=8+down16.block_n=64
for ctx in 256 4096; do
  python3 bench/forward_levers.py --out "$out/levers-8b-$ctx" --model llama-3.1-8b --buckets 8 --decodes 1 \
    --context $ctx --variants "prod,prod+attn.splits=4,$old8,prod" --profile none 2>&1 | grep "^| prod"
done
python3 bench/forward_levers.py --out "$out/levers-1b-256" --model llama-3.2-1b --buckets 8 --decodes 1 \
  --variants "prod,prod+down16.block_n=64,prod" --profile none 2>&1 | grep "^| prod"
export PYTHONUNBUFFERED=1 PYTHONPATH=.
python3 bench/http_sweep.py --model dummy:llama-3.1-8b --geometries 8192/1024/256/2048 --cases b1-greedy b1-t1.0 \
  --requests-per-case 5 --budget-s 200 --out "$out/http-8b.json" 2>&1 | grep -v -i warn | tail -5
python3 bench/http_sweep.py --geometries 8192/1024/256/2048 --cases b1-greedy b1-t1.0 \
  --requests-per-case 5 --budget-s 150 --out "$out/http-1b.json" 2>&1 | grep -v -i warn | tail -5
