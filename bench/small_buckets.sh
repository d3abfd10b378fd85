#!/usr/bin/env bash
# Batch 1 through HTTP with the 1-, 2- and 4-token buckets (profile.py DEFAULT_BUCKETS) against the
# buckets before them (8 smallest), same call: 1B at the shipped geometry and at 32768/4096, 8B at the
# shipped geometry. The old buckets are the new default with 1, 2 and 4 cut by sed in the device's copy.
# Usage, on the GPU host with the tree installed: bash bench/small_buckets.sh OUT_DIR
set -uo pipefail
out=${1:?OUT_DIR}
export PYTHONUNBUFFERED=1 PYTHONPATH=.
sweep() {  # name, extra args
  local name=$1; shift
  python3 bench/http_sweep.py --cases b1-greedy b1-t1.0 --requests-per-case 5 --budget-s 250 \
    --out "$out/$name.json" "$@" 2>&1 | grep -v -i warn | grep "^|" | tail -4
}
sweep new-1b --geometries 8192/1024/256/2048 32768/4096/256/2048
sweep new-8b --model dummy:llama-3.1-8b --geometries 8192/1024/256/2048
sed -i 's/^DEFAULT_BUCKETS = (1, 2, 4, 8,/DEFAULT_BUCKETS = (8,/' blink_appliance/profile.py
grep -n "^DEFAULT_BUCKETS" blink_appliance/profile.py
sweep old-1b --geometries 8192/1024/256/2048
sweep old-8b --model dummy:llama-3.1-8b --geometries 8192/1024/256/2048
sed -i 's/^DEFAULT_BUCKETS = (8,/DEFAULT_BUCKETS = (1, 2, 4, 8,/' blink_appliance/profile.py
