#!/usr/bin/env bash
# Nsight Compute on the batch-1 step, 1B bf16 (the card is named first): every kernel of one forward
# replay (throughput, occupancy, warp stalls), then one host-driven launch of each loop kernel named
# (default schedule_kernel) at the shipped geometry with its source-line counters. Clocks are left
# alone (--clock-control none). CSVs land in OUT_DIR as forward-*.csv and KERNEL-*.csv;
# bench/ncu_summary.py reads them.
# Usage, on the GPU host: bash bench/ncu_step.sh OUT_DIR [forward|loop|both] [KERNEL ...]
set -uo pipefail
out=${1:?OUT_DIR}
what=${2:-both}
shift $(( $# < 2 ? $# : 2 ))
kernels=${*:-schedule_kernel}
source bench/device_tree.sh
ncu --version | tail -1
sections="--section SpeedOfLight --section LaunchStats --section Occupancy --section WarpStateStats --section MemoryWorkloadAnalysis"
if [ "$what" != loop ]; then
  timeout 240 ncu --clock-control none --profile-from-start off $sections -f -o "$out/forward" \
    python3 bench/ncu_forward.py 2>&1 | grep -v -i warn | tail -3
  ncu -i "$out/forward.ncu-rep" --page details --csv > "$out/forward-details.csv"
fi
[ "$what" = forward ] && exit 0
for k in $kernels; do
  timeout 300 ncu --clock-control none -k "regex:^$k\$" --launch-skip 12 --launch-count 1 \
    --section WarpStateStats --section SourceCounters --section SpeedOfLight --warp-sampling-interval 0 \
    --import-source yes -f -o "$out/$k" \
    python3 bench/loop_profile.py --geometries 8192/1024/256/2048 --batches 1 --steps 20 --no-loop --sampled 0 \
    --out "$out/loop-profile.json" 2>&1 | grep -v -i warn | tail -2
  ncu -i "$out/$k.ncu-rep" --page details --csv > "$out/$k-details.csv"
  ncu -i "$out/$k.ncu-rep" --page source --csv --print-source cuda,sass > "$out/$k-source.csv"
  rm -f "$out/$k.ncu-rep"
done
ls -la "$out"
