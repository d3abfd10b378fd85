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
fetch py-spy  # bench/frontend_load.py samples the front end with it
core=$(unzip -p .whl/pydantic-*.whl '*/METADATA' | sed -n 's/^Requires-Dist: pydantic-core==\([0-9.]*\).*/\1/p')
fetch "pydantic-core==${core}"
ls .whl
