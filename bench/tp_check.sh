#!/usr/bin/env bash
# One device call on two GPUs (nvidia-h100-x2): the tensor-parallel tests, then the TP=2 forward
# against TP=1 by graph replay (bench/tp_forward.py). A hang prints the host's stacks (pytest's
# faulthandler_timeout, tp_forward's --hang-s) instead of eating the call.
# Usage, on the GPU host from the repo root with the wheels in .whl/: bash bench/tp_check.sh OUT_DIR [model]
set -uo pipefail
# Every module loaded when the context starts, not at a kernel's first launch: a lazy load while one
# rank spins on its peer is the hang this check looks for (warm_alone should already prevent it).
export CUDA_MODULE_LOADING=EAGER
out=${1:?OUT_DIR}
model=${2:-llama-3.1-8b}
mkdir -p "$out"
python3 -m pip install -q --no-deps .whl/*.whl && python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 || exit 1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
nvidia-smi topo -m | head -3
timeout 240 python3 -m pytest -q -rs -p no:cacheprovider -o faulthandler_timeout=90 tests/test_tensor_parallel.py 2>&1 | tail -40
PYTHONUNBUFFERED=1 PYTHONPATH=. timeout 330 python3 bench/tp_forward.py --model "$model" --buckets 1,8,128 \
  --hang-s 300 --out "$out/tp-forward.json" 2>&1 | grep -v -i "warn"
