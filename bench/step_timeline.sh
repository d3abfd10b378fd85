#!/usr/bin/env bash
# Where batch 1's forward goes on the device's own timeline, 1B bf16 (the card is named first): the
# graph replay kernel by kernel, with the idle time between kernels apart; then, given more arguments,
# the same replay for each forward_levers.py variant named (e.g. prod+qkv16.split_k=2), without profile.
# Usage, on the GPU host: bash bench/step_timeline.sh OUT_DIR [variant ...]
set -uo pipefail
out=${1:?OUT_DIR}; shift
source bench/device_tree.sh
timeout 200 python3 bench/forward_levers.py --model llama-3.2-1b --buckets 1 --decodes 1 --variants prod \
  --graph-profile --out "$out/forward" 2>&1 | grep -v -i warn | tail -22
if [ $# -gt 0 ]; then
  variants=$(IFS=,; echo "prod,$*,prod")
  timeout 300 python3 bench/forward_levers.py --model llama-3.2-1b --buckets 1 --decodes 1 --variants "$variants" \
    --profile none --out "$out/levers" 2>&1 | grep -v -i warn | grep -A40 "^## "
fi
