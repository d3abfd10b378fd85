#!/usr/bin/env bash
# One device call: does the commit kernel's system-scope fence (kernels/ring_access.py fence_sys, called by kernels/commit.py) stop
# the front end from seeing a count before the tokens it covers? On the GPU host, from the repo root,
# with the wheels of scripts/device_wheels.sh carried in .whl/. The control run with the kernel from
# before the fence (315 late tokens) is recorded in bench/results/2026-11-25-h100-commit-fence.md; that
# kernel no longer fits today's launcher, which passes its arguments by name.
#   bash bench/fence_check.sh [ROUNDS]      (logs under $OUT: at most 8 files come back)
# 1. the GPU loop tests (the 64-sequence runs assert no payload waits);
# 2. bench/loop_cpu_time.py, loop mode, batch 64, 160 tokens, ROUNDS times with the fence;
set -uo pipefail
rounds=${1:-3}
out=${OUT:-/tmp/fence_check}
mkdir -p "$out"
python3 -m pip install -q --no-deps .whl/*.whl && python3 -m pip install -q --no-deps --no-build-isolation -e . || exit 1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
python3 -m pytest -q -p no:cacheprovider tests/test_loop_step.py tests/test_device_commit.py \
    tests/test_device_loop.py 2>&1 | tee "$out/tests.log" | tail -4
for r in $(seq 1 "$rounds"); do
    PYTHONUNBUFFERED=1 python3 bench/loop_cpu_time.py --modes loop --batches 64 --tokens 160 \
        --idle-s 0.5 --start-timeout 300 > "$out/fence-$r.log" 2>&1
    echo "fence round $r: exit $? $(grep -c . "$out/fence-$r.log") lines"; tail -4 "$out/fence-$r.log"
done
