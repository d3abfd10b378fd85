#!/usr/bin/env bash
# The schedule's steady decode step (kernels/schedule_steady.py) on a GPU, this tree against a base
# tree (bench/ab_trees.sh: the base packed as .whl/base.tar.gz), in one call:
#   (no mode)  the GPU tests (the steady step against the full path, greedy loop streams against the
#              reference engine), then batch-1 and batch-64 greedy TPOT through HTTP at the shipped
#              geometry, this tree first and the base second (a later run in a call tends to be a few
#              µs faster, so the order favours the base)
#   http       the HTTP part alone;  tests  the tests alone
#   profile    the tests, then the loop's pieces per tree (bench/loop_ab.sh profile)
# Usage, on the GPU host: bash bench/steady_check.sh OUT_DIR [http|tests|profile]
set -uo pipefail
out=${1:?OUT_DIR}
mode=${2:-all}
source bench/ab_trees.sh
if [ "$mode" != http ]; then
  timeout 240 python3 -m pytest -q -n 8 --dist load --durations=8 tests/test_device_scheduler_steady.py \
    "tests/test_device_loop.py::test_engine_loop_greedy_streams_equal_host_steps_and_the_reference_engine" \
    > "$out/gpu-tests.log" 2>&1
  echo "gpu tests rc=$?"; tail -3 "$out/gpu-tests.log"
fi
[ "$mode" = tests ] && exit 0
[ "$mode" = profile ] && { bash bench/loop_ab.sh "$out" profile; exit 0; }
for tree in new base; do
  dir=$here; [ $tree = base ] && dir=/tmp/base
  install "$dir"
  (cd "$dir" && PYTHONPATH=. timeout 250 python3 bench/http_sweep.py --cases b1-greedy b64-greedy \
    --requests-per-case 3 --budget-s 200 --geometries 8192/1024/256/2048 --out "$out/http-$tree.json" 2>&1 \
    | grep -v -i warn | grep "^| 8192" | sed "s/^/$tree /")
done
install "$here"
