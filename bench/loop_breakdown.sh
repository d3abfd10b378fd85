#!/usr/bin/env bash
# The loop's step by piece (schedule phases, forward, sampler, commit; host-driven, CUDA events) and
# batch-1 TPOT through HTTP, 1B at the shipped geometry, in one call: the card is named first.
# Usage, on the GPU host: bash bench/loop_breakdown.sh OUT_DIR [extra http_sweep cases...]
set -uo pipefail
out=${1:?OUT_DIR}; shift
source bench/device_tree.sh
timeout 240 python3 bench/loop_profile.py --geometries 8192/1024/256/2048 --batches 1 64 --steps 30 \
  --no-loop --schedule-phases --out "$out/loop-profile.json" 2>&1 | grep -v -i warn | tail -25
timeout 240 python3 bench/http_sweep.py --cases b1-greedy b1-t1.0 "$@" --requests-per-case 5 --budget-s 200 \
  --geometries 8192/1024/256/2048 --out "$out/http-1b.json" 2>&1 | grep -v -i warn | grep "^|" | tail -6
