#!/usr/bin/env bash
# One device call: the GPU loop's logprobs and penalties. The GPU tests that cover them (kernels
# against the reference, the loop's streams and rows end to end, schedule's record checks), then
# the step's pieces at the shipped geometry with and without logprobs=5 (and penalties) on every row.
# On the GPU host, from the repo root, with the wheels of scripts/device_wheels.sh in .whl/:
#   bash bench/logprobs_check.sh       (logs and JSON under $OUT)
set -uo pipefail
out=${OUT:-/tmp/logprobs_check}
mkdir -p "$out"
python3 -m pip install -q --no-deps .whl/*.whl && python3 -m pip install -q --no-deps --no-build-isolation -e . || exit 1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$out/logprobs-tests.log"
python3 -m pytest -q -rs -p no:cacheprovider tests/test_device_logprobs.py tests/test_device_penalties.py tests/test_device_sampler.py \
    tests/test_device_scheduler_records.py tests/test_loop_step.py 2>&1 | tee -a "$out/logprobs-tests.log" | tail -15
PYTHONUNBUFFERED=1 PYTHONPATH=. python3 bench/loop_profile.py --geometries "${GEOMETRY:-8192/1024/256/2048}" \
    --batches 1 64 --logprobs 5 ${PROFILE_ARGS:-} --steps "${STEPS:-40}" --out "$out/loop-profile-logprobs.json" 2>&1 \
    | tee "$out/loop-profile-logprobs.log" | grep -v "^\[" | tail -30
