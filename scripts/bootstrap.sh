#!/usr/bin/env bash
# Create .venv and install the appliance with its test tools. Idempotent.
# torch is pinned to 2.13.0 first: on CPU machines that is the local CPU wheel; an open range
# would pull a multi-GB CUDA build from PyPI.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$PY" -m venv .venv
fi
find_links=()
[ -d /opt/wheels ] && find_links=(--find-links /opt/wheels)
.venv/bin/python -m pip install -q --disable-pip-version-check "${find_links[@]}" "torch==${BLINK_TORCH_VERSION:-2.13.0}"
.venv/bin/python -m pip install -q --disable-pip-version-check "${find_links[@]}" -e ".[dev]"
