#!/usr/bin/env bash
# A grid barrier in one persistent kernel against PDL kernel boundaries: 16 layers of one-row QKV + O, in Triton
# (bench/persistent_chain.py) and in CUDA C++ (bench/persistent_chain_cuda.py); the card is named first.
# Usage, on the GPU host: bash bench/persistent_chain.sh OUT_DIR [triton] [cuda] (default: both)
set -uo pipefail
out=${1:?OUT_DIR}; shift
parts=${*:-triton cuda}
source bench/device_tree.sh
[[ $parts == *triton* ]] && timeout 240 python3 bench/persistent_chain.py --out "$out/persistent-chain.json" 2>&1 | grep -v -i warn | tail -20
[[ $parts == *cuda* ]] && timeout 200 python3 bench/persistent_chain_cuda.py --out "$out/persistent-chain-cuda.json" 2>&1 | grep -v -i warn | tail -60
