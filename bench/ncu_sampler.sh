#!/usr/bin/env bash
# Nsight Compute on the device sampler's kernels (the card is named first): for each ROWS:MIX pair, the
# 13th eager launch of KERNEL with source-line counters (bench/ncu_sampler.py). Clocks are left alone.
# CSVs land in OUT_DIR as KERNEL-ROWS-MIX-details.csv / -source.csv (MIX's letters and digits); bench/ncu_summary.py reads them.
# Usage, on the GPU host: bash bench/ncu_sampler.sh OUT_DIR KERNEL ROWS "MIX" [KERNEL ROWS "MIX" ...]
set -uo pipefail
out=${1:?OUT_DIR}
shift
source bench/device_tree.sh
ncu --version | tail -1
while [ $# -ge 3 ]; do
  k=$1 rows=$2 mix=$3
  shift 3
  name="$k-$rows-$(echo "$mix" | tr -cd 'a-z0-9')"
  timeout 240 ncu --clock-control none -k "regex:^$k\$" --launch-skip 12 --launch-count 1 \
    --section WarpStateStats --section SourceCounters --section SpeedOfLight --section LaunchStats \
    --section Occupancy --warp-sampling-interval 0 --import-source yes -f -o "$out/$name" \
    python3 bench/ncu_sampler.py --rows "$rows" --mix "$mix" 2>&1 | grep -v -i warn | tail -2
  ncu -i "$out/$name.ncu-rep" --page details --csv > "$out/$name-details.csv"
  ncu -i "$out/$name.ncu-rep" --page source --csv --print-source cuda,sass > "$out/$name-source.csv"
  rm -f "$out/$name.ncu-rep"
done
ls -la "$out"
