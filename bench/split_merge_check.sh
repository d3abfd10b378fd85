#!/usr/bin/env bash
# Batch 1's attention splits on the GPU, in one call: the host-driven step and loop TPOT over trees
# (bench/profile_trees.sh: TREES, e.g. "here A=.whl/trees/ecac9bc.tar.gz"), the 1-token bucket's
# forward by graph replay at 4096 keys (this tree's plan against 16 splits), then the attention
# kernel's tests.
# Usage, on the GPU host: TREES="..." bash bench/split_merge_check.sh OUT_DIR
set -uo pipefail
out=${1:?OUT_DIR}
bash bench/profile_trees.sh "$out" $TREES 2>&1 | tail -n +2
PYTHONPATH=. timeout 100 python3 bench/forward_levers.py --buckets 1 --decodes 1 --context 4096 \
  --variants prod,prod+attn.splits=16 --profile none --out "$out/forward-4096" 2>&1 \
  | grep -v -i warn | grep "^| prod" | sed "s/^/keys=4096 /"
timeout 75 python3 -m pytest -q -n 12 tests/test_kernels_attention.py > "$out/gpu-tests.log" 2>&1
echo "attention tests rc=$?"; tail -1 "$out/gpu-tests.log"
