#!/usr/bin/env bash
# SM provisioning under MPS (the fallback when green contexts do not hold for the loop's graphs):
# a private MPS control daemon, then probe clients at active-thread percentages, alone and together.
#   bash bench/mps_probe.sh [PCT_A PCT_B]
set -uo pipefail
cd "$(dirname "$0")/.."
A=${1:-25}; B=${2:-75}
export CUDA_MPS_PIPE_DIRECTORY=$(mktemp -d /tmp/blink-mps-pipe.XXXX) CUDA_MPS_LOG_DIRECTORY=$(mktemp -d /tmp/blink-mps-log.XXXX)
nvidia-cuda-mps-control -d || { echo "MPS control daemon did not start"; exit 1; }
probe() { CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=$1 python3 bench/sm_partition_probe.py --mps-client "$2" --start-at "$3" 2>&1 | grep "^\[mps"; }
now() { python3 -c "import time; print(time.time() + $1)"; }
probe "$A" "A alone" 0
probe "$B" "B alone" 0
T=$(now 25); probe "$A" "A with B" "$T" & probe "$B" "B with A" "$T" & wait
T=$(now 25); probe 100 "A' with B', no limit" "$T" & probe 100 "B' with A', no limit" "$T" & wait
echo quit | nvidia-cuda-mps-control
cat "$CUDA_MPS_LOG_DIRECTORY"/control.log | tail -5
