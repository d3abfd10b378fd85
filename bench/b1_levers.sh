#!/usr/bin/env bash
# Batch-1 launch-shape levers for 1B and 8B at bucket 8 (one decoding sequence, 256-token context),
# graph replay per variant (bench/forward_levers.py). Usage: bash bench/b1_levers.sh OUT_DIR [VARIANTS]
set -euo pipefail
out=${1:?OUT_DIR}
V=${2:-prod,prod+attn.fused_rope=1,prod+attn.splits=4,prod+attn.splits=8,prod+attn.splits=4+attn.block_n=32,prod+attn.splits=1+attn.block_n=64,prod+down16.block_n=128,prod+down16.block_n=128+down16.split_k=16,prod+qkv16.split_k=2,prod+o16.split_k=2,prod+down16.block_n=128+qkv16.split_k=2+o16.split_k=2,prod}
for m in llama-3.2-1b llama-3.1-8b; do
  python3 bench/forward_levers.py --out "$out/$m" --model "$m" --buckets 8 --decodes 1 --variants "$V" --profile prod 2>&1 \
    | grep -v -i warning | sed -n '/^prod T=8/,$p'
done
