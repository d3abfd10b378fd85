#!/usr/bin/env bash
# One device call: batch 1's attention plan (RoPE fused, 4-warp programs, 32-key tiles) against the
# plan before it, 1B and 8B at 256 and 4096 keys (graph replay), then the GPU tests it touches, then
# batch-1 TPOT through HTTP at the shipped geometry while time is left. The card is named first.
# Usage, on the GPU host: bash bench/b1_fused_rope.sh OUT_DIR
set -uo pipefail
out=${1:?OUT_DIR}
source bench/device_tree.sh
old=prod+attn.fused_rope=0+attn.num_warps=1+attn.block_n=16
for model in llama-3.2-1b llama-3.1-8b; do
  for ctx in 256 4096; do
    timeout 100 python3 bench/forward_levers.py --model $model --buckets 1 --decodes 1 --context $ctx \
      --variants prod,$old,prod --profile none --out "$out/levers-$model-$ctx" 2>&1 | grep -v -i warn | grep -A6 "^## "
  done
done
timeout 210 python3 -m pytest -q -p no:cacheprovider -n 6 --dist loadfile tests/test_gpu_forward.py \
  tests/test_launch_plans.py tests/test_loop_engine_server.py tests/test_device_loop.py 2>&1 | tail -4
timeout 170 python3 bench/http_sweep.py --cases b1-greedy --requests-per-case 5 --budget-s 160 \
  --geometries 8192/1024/256/2048 --out "$out/http-1b.json" 2>&1 | grep -v -i warn | grep "^|" | tail -4
