#!/usr/bin/env bash
# One device call on two GPUs (nvidia-h100-x2): the tensor-parallel tests, then 8B's TP=2 forward
# against TP=1 by graph replay (bench/tp_forward.py), in bf16 and in fp32 (where the two differ only
# in the order of fp32 sums). A hang prints where each rank's exchange stands (--watch-s) and the
# host's stacks (pytest's faulthandler_timeout, --hang-s) instead of eating the call.
# Usage, on the GPU host from the repo root with the wheels in .whl/: bash bench/tp_check.sh OUT_DIR [model]
set -uo pipefail
source "$(dirname "$0")/tp_setup.sh" "$@"
model=${2:-llama-3.1-8b}
nvidia-smi topo -m | head -3
timeout 150 python3 -m pytest -q -rs -p no:cacheprovider -o faulthandler_timeout=120 tests/test_tensor_parallel.py \
  "tests/test_device_loop.py::test_switches_route_to_real_forward_bucket_graphs" 2>&1 | tail -5
timeout 240 python3 bench/tp_forward.py --model "$model" --buckets 1,8,128 --greedy 32 --watch-s 30 --hang-s 230 \
  --out "$out/tp-forward-bf16.json" 2>&1 | grep -v -i warn
timeout 200 python3 bench/tp_forward.py --model "$model" --buckets 1,8 --greedy 32 --watch-s 30 --hang-s 190 \
  --dtype float32 --out "$out/tp-forward-fp32.json" 2>&1 | grep -v -i warn
