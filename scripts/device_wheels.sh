#!/usr/bin/env bash
# Fetch into .whl/ the wheels the GPU host's image lacks (its Python is 3.12), for the device
# tool's `carry: [".whl"]`. There: python3 -m pip install -q --no-deps .whl/*.whl
# Pure-Python wheels except pydantic-core, whose version is the one pydantic pins.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
grep -qx "/.whl/" .git/info/exclude 2>/dev/null || { mkdir -p .git/info && echo "/.whl/" >> .git/info/exclude; }
rm -rf .whl
fetch() {
    "$PY" -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: \
        --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 \
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl "$@"
}
fetch pydantic annotated-types typing-inspection typing-extensions gguf platformdirs pytest-asyncio
fetch pytest-xdist execnet  # bench/gpu_suite.sh runs the GPU test files in parallel
fetch outlines-core  # the front end compiles structured-output constraints with it (a serving dependency)
fetch py-spy  # bench/frontend_load.py samples the front end with it
# The NIXL front end (bench/nixl_frontend.py): nixl-cu13 cut down to its UCX backend and packed as
# .whl/nixl-cu13-trimmed.tar.xz (the whole wheel, with an expert-parallel torch extension and storage
# plugins, is over the device's carry limit). There: tar -xJf .whl/nixl-cu13-trimmed.tar.xz -C /tmp/nixl
# and PYTHONPATH=/tmp/nixl.
fetch nixl-cu13
nixl=$(mktemp -d)
unzip -q .whl/nixl_cu13-*.whl 'nixl_cu13/*' 'nixl_cu13.libs/*' '.nixl_cu13.mesonpy.libs/*' -d "$nixl"
for plugin in AZURE_BLOB GDS GDS_MT GPUNETIO GUSLI INFINIA LIBFABRIC OBJ POSIX; do
    rm -f "$nixl/nixl_cu13.libs/nixl/libplugin_$plugin.so"
done
rm -f "$nixl"/nixl_cu13.libs/ucx/libucx_perftest*
tar -cJf .whl/nixl-cu13-trimmed.tar.xz -C "$nixl" nixl_cu13 nixl_cu13.libs .nixl_cu13.mesonpy.libs
rm -rf "$nixl" .whl/nixl_cu13-*.whl
core=$(unzip -p .whl/pydantic-*.whl '*/METADATA' | sed -n 's/^Requires-Dist: pydantic-core==\([0-9.]*\).*/\1/p')
fetch "pydantic-core==${core}"
ls .whl
