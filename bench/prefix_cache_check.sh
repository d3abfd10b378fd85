#!/usr/bin/env bash
# One device call: the GPU loop's prefix cache. The GPU tests that cover it (the schedule step against
# the reference block for block, commit's releases, the loop end to end), then the step's pieces at
# the shipped geometry with the cache on and off (decode steps: what the cache adds to every step).
# On the GPU host, from the repo root, with the wheels of scripts/device_wheels.sh in .whl/:
#   bash bench/prefix_cache_check.sh       (logs and JSON under $OUT)
# The multi-turn chat workload is a second call: bench/prefix_cache_chat.py (its docstring).
set -uo pipefail
out=${OUT:-/tmp/prefix_cache_check}
mkdir -p "$out"
python3 -m pip install -q --no-deps .whl/*.whl && python3 -m pip install -q --no-deps --no-build-isolation -e . || exit 1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$out/prefix-cache-tests.log"
python3 -m pytest -q -rs -p no:cacheprovider ${TESTS:-tests/test_device_prefix_cache.py tests/test_device_commit.py \
    tests/test_loop_step.py} 2>&1 | tee -a "$out/prefix-cache-tests.log" | tail -15
for cache in on off; do
    flag=""; [ "$cache" = off ] && flag="--no-prefix-cache"
    PYTHONUNBUFFERED=1 PYTHONPATH=. python3 bench/loop_profile.py --geometries "${GEOMETRY:-8192/1024/256/2048}" \
        --batches 1 64 --sampled 0 $flag --steps "${STEPS:-40}" --out "$out/loop-profile-cache-$cache.json" 2>&1 \
        | tee "$out/loop-profile-cache-$cache.log" | grep -v "^\[" | tail -12
done
