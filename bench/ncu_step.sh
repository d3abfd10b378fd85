#!/usr/bin/env bash
# Nsight Compute on the batch-1 step, 1B bf16 (the card is named first): every kernel of one forward
# replay (throughput, occupancy, warp stalls), then one host-driven schedule launch at the shipped
# geometry with its source-line counters. Clocks are left alone (--clock-control none). CSVs land
# in OUT_DIR; bench/ncu_summary.py reads them.
# Usage, on the GPU host: bash bench/ncu_step.sh OUT_DIR [forward|schedule]  (default: both)
set -uo pipefail
out=${1:?OUT_DIR}
what=${2:-both}
source bench/device_tree.sh
ncu --version | tail -1
sections="--section SpeedOfLight --section LaunchStats --section Occupancy --section WarpStateStats --section MemoryWorkloadAnalysis"
if [ "$what" != schedule ]; then
  timeout 240 ncu --clock-control none --profile-from-start off $sections -f -o "$out/forward" \
    python3 bench/ncu_forward.py 2>&1 | grep -v -i warn | tail -3
  ncu -i "$out/forward.ncu-rep" --page details --csv > "$out/forward-details.csv"
fi
[ "$what" = forward ] && exit 0
timeout 300 ncu --clock-control none -k regex:schedule_kernel --launch-skip 12 --launch-count 1 \
  --section WarpStateStats --section SourceCounters --section SpeedOfLight --warp-sampling-interval 0 --import-source yes -f -o "$out/schedule" \
  python3 bench/loop_profile.py --geometries 8192/1024/256/2048 --batches 1 --steps 20 --no-loop --sampled 0 \
  --out "$out/loop-profile.json" 2>&1 | grep -v -i warn | tail -3
ncu -i "$out/schedule.ncu-rep" --page details --csv > "$out/schedule-details.csv"
ncu -i "$out/schedule.ncu-rep" --page source --csv --print-source cuda,sass > "$out/schedule-source.csv" 2> "$out/source-err.txt" \
  || ncu -i "$out/schedule.ncu-rep" --page source --csv > "$out/schedule-source.csv"
ls -la "$out"; head -c 600 "$out/source-err.txt"
