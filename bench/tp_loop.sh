#!/usr/bin/env bash
# One device call on two GPUs (nvidia-h100-x2): the tensor-parallel GPU loop end to end.
# 1. The loop server's GPU test at TP=2: greedy streams equal to the CPU reference
#    engine's, cancel, shutdown (tests/test_loop_engine_server.py, the tiny model in fp32).
# 2. 8B bf16 batch 1 through `blink-appliance up` at the shipped geometry, TP=2 then TP=1
#    (bench/http_sweep.py): TPOT, start-up, and the engine's CPU seconds per 1k tokens. TP=2 runs
#    only once its test has passed.
# Usage, on the GPU host from the repo root with the wheels in .whl/: bash bench/tp_loop.sh OUT_DIR
set -uo pipefail
source "$(dirname "$0")/tp_setup.sh" "$@"
timeout 200 python3 -m pytest -q -rs -p no:cacheprovider -o faulthandler_timeout=150 -k "tp2" \
  "tests/test_loop_engine_server.py::test_greedy_streams_through_the_loop_equal_the_reference_engine_and_cancel_and_shutdown_work" \
  > "$out/pytest-tp2.log" 2>&1
passed=$?
tail -30 "$out/pytest-tp2.log"
for tp in 2 1; do
  if [ "$tp" = 2 ] && [ "$passed" != 0 ]; then echo "== TP=2 test failed: no TP=2 HTTP run"; continue; fi
  timeout 230 python3 bench/http_sweep.py --model dummy:llama-3.1-8b --geometries 8192/1024/256/2048 \
    --cases b1-greedy --requests-per-case 3 --tensor-parallel $tp --budget-s 215 --startup-timeout 200 \
    --out "$out/http-8b-tp$tp.json" 2>&1 | grep -v -i warn | tail -8
  grep -h -i "error\|Traceback\|hang" "$out"/http-8b-tp$tp-*.log 2>/dev/null | head -20
done
