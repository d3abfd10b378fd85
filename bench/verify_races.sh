#!/usr/bin/env bash
# One device call: the loop's GPU tests, bench/loop_stress.py and the sampler stress on this tree,
# for changes to the loop kernels' memory ordering (commit, prefix cache, sampler rounds). The tests get
# 330 s so the rest fits the call's 10 minutes; on 2026-11-29 that reached 91% of them.
# Usage, on the GPU host: OUT=... bash bench/verify_races.sh
source bench/device_tree.sh
GPU_SUITE_WORKERS=6 OUT=$OUT timeout 330 bash bench/gpu_suite.sh tests/test_device_loop.py tests/test_device_scheduler.py tests/test_device_scheduler_records.py tests/test_loop_step.py tests/test_loop_engine_server.py tests/test_device_commit.py tests/test_device_prefix_cache.py tests/test_loop_engine_lifecycle.py 2>&1 | tail -15
timeout 150 python3 bench/loop_stress.py --out $OUT > $OUT/loop-stress.log 2>&1; echo "loop_stress rc=$?"; tail -12 $OUT/loop-stress.log
STRESS_ARGS="--check 200" timeout 100 bash bench/stress_trees.sh $OUT 20 2 here
