#!/usr/bin/env bash
# One device call: the GPU test suite on the current tree (every kernel, forward and loop test file;
# on a GPU their CUDA variants run and the interpreter-only ones skip, saying why).
# On the GPU host, from the repo root, with the wheels of scripts/device_wheels.sh carried in .whl/:
#   bash bench/gpu_suite.sh            (log under $OUT/gpu-suite.log)
#   bash bench/gpu_suite.sh tests/test_loop_*.py     (a part of it)
# The files run in parallel (pytest-xdist, GPU_SUITE_WORKERS, 4 by default): serially the suite took
# about 11 minutes, past one call's 10, mostly Triton compiling on the CPU.
set -uo pipefail
out=${OUT:-/tmp/gpu_suite}
mkdir -p "$out"
python3 -m pip install -q --no-deps .whl/*.whl && python3 -m pip install -q --no-deps --no-build-isolation -e . || exit 1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$out/gpu-suite.log"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$out/gpu-suite.log"
if [ "$#" -gt 0 ]; then files=("$@"); else
    files=(tests/test_kernels_*.py tests/test_gpu_forward*.py tests/test_paged_attention_plan.py tests/test_device_*.py
           tests/test_loop_*.py)
fi
python3 -m pytest -q -rs -p no:cacheprovider -n "${GPU_SUITE_WORKERS:-4}" --dist loadfile "${files[@]}" 2>&1 | tee -a "$out/gpu-suite.log" | tail -25
