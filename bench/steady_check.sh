#!/usr/bin/env bash
# The schedule's steady decode step (kernels/schedule_steady.py) on a GPU, in one call: the schedule's
# and the loop's GPU tests (the steady step against the full path and the CPU reference, greedy loop
# streams against the reference engine), then the loop's pieces against a base tree
# (bench/loop_ab.sh profile; the base packed as .whl/base.tar.gz, carried with the wheels).
# Usage, on the GPU host: bash bench/steady_check.sh OUT_DIR [tests]   (tests: the tests alone)
set -uo pipefail
out=${1:?OUT_DIR}
source bench/device_tree.sh
timeout 300 python3 -m pytest -q -n 8 --dist loadfile tests/test_device_scheduler_steady.py \
  tests/test_device_scheduler.py tests/test_device_scheduler_records.py tests/test_device_prefix_cache.py \
  tests/test_device_loop.py tests/test_loop_step.py > "$out/gpu-tests.log" 2>&1
echo "gpu tests rc=$?"; tail -3 "$out/gpu-tests.log"
[ "${2:-}" = tests ] && exit 0
bash bench/loop_ab.sh "$out" profile
