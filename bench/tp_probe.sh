#!/usr/bin/env bash
# One device call on two GPUs (nvidia-h100-x2): which way of launching the TP=2 step completes.
# 1B, TP=2 only, buckets 1 and 8: graphs with PDL, graphs without, kernel by kernel; a step over
# 20 s prints each rank's epoch and exchange flags (bench/tp_forward.py --watch-s). Then 8B against
# TP=1 (buckets 1 and 8, 16 greedy tokens) in the first way that completed.
# Usage, on the GPU host from the repo root with the wheels in .whl/: bash bench/tp_probe.sh OUT_DIR
set -uo pipefail
source "$(dirname "$0")/tp_setup.sh" "$@"
timeout 90 python3 -m pytest -q -rs -p no:cacheprovider -o faulthandler_timeout=80 tests/test_tensor_parallel.py 2>&1 | tail -5
works=""
for way in "" "--no-pdl" "--eager"; do
  echo "== 1B TP=2 ${way:-graphs+pdl}"
  if timeout 120 python3 bench/tp_forward.py --model llama-3.2-1b --buckets 1,8 --tp-only --greedy 0 \
      --watch-s 20 --hang-s 110 $way --out "$out/probe-1b${way}.json" 2>&1 | grep -v -i warn; then
    [ -f "$out/probe-1b${way}.json" ] && [ -z "$works" ] && works="${way:-none}"
  fi
done
echo "== first way that completed: ${works:-none}"
[ -z "$works" ] && exit 0
[ "$works" = none ] && works=""
timeout 200 python3 bench/tp_forward.py --model llama-3.1-8b --buckets 1,8 --greedy 16 --watch-s 20 \
  --hang-s 190 $works --out "$out/tp-forward-8b.json" 2>&1 | grep -v -i warn
