#!/usr/bin/env bash
# The schedule's steady decode step through HTTP, in one call: its GPU tests (the steady step against
# the full path, greedy loop streams against the reference engine), then batch-1 and batch-64 greedy
# TPOT at the shipped geometry, this tree first and the base tree second (bench/ab_trees.sh: the base
# packed as .whl/base.tar.gz). A later run in a call tends to be a few µs faster, so the order favours
# the base.
# Usage, on the GPU host: bash bench/steady_http.sh OUT_DIR [http]   (http: without the tests)
set -uo pipefail
out=${1:?OUT_DIR}
source bench/ab_trees.sh
if [ "${2:-}" != http ]; then
  timeout 240 python3 -m pytest -q -n 8 --dist load --durations=8 tests/test_device_scheduler_steady.py \
    "tests/test_device_loop.py::test_engine_loop_greedy_streams_equal_host_steps_and_the_reference_engine" \
    > "$out/gpu-tests.log" 2>&1
  echo "gpu tests rc=$?"; tail -3 "$out/gpu-tests.log"
fi
for tree in new base; do
  dir=$here; [ $tree = base ] && dir=/tmp/base
  install "$dir"
  (cd "$dir" && PYTHONPATH=. timeout 250 python3 bench/http_sweep.py --cases b1-greedy b64-greedy \
    --requests-per-case 3 --budget-s 200 --geometries 8192/1024/256/2048 --out "$out/http-$tree.json" 2>&1 \
    | grep -v -i warn | grep "^| 8192" | sed "s/^/$tree /")
done
install "$here"
