#!/usr/bin/env bash
# Create .venv and install the appliance: `bootstrap.sh serve` (what `make up` needs: torch and the
# runtime dependencies) or `bootstrap.sh dev` (that plus the test tools, for `make test`).
#
# pip runs only when something it would act on changed: a stamp in .venv records a hash of
# pyproject.toml, this script, the Python and the torch pin, and which extra was installed. The dev
# extra covers serve, so `make up` after `make test` never drops the test tools.
#
# torch is pinned to 2.13.0 in the same pip call: on CPU machines that is the local CPU wheel; an
# open range would pull a multi-GB CUDA build from PyPI.
set -euo pipefail
cd "$(dirname "$0")/.."

want=${1:-serve}
case "$want" in
serve | dev) ;;
*)
    echo "usage: scripts/bootstrap.sh [serve|dev]" >&2
    exit 2
    ;;
esac

PY=${PYTHON:-python3}
torch_version=${BLINK_TORCH_VERSION:-2.13.0}
stamp=.venv/.blink-bootstrap
# The modules each appliance process imports (daemon, engine, front end, dashboard); the warm-up
# below byte-compiles exactly what they pull in. tests/test_bootstrap.py checks they exist.
serving_modules=(
    blink_appliance.cli blink_appliance.daemon
    torch blink_appliance.engine.process blink_appliance.engine.reference.engine
    blink_appliance.engine.reference.server blink_appliance.model.loaders blink_appliance.wire.shm_transport
    blink_appliance.frontend.app blink_appliance.tui.app
)

say() { echo "[setup] $*"; }
start=$SECONDS

if [ ! -x .venv/bin/python ]; then
    say "creating .venv with $("$PY" --version 2>&1) (a few seconds)"
    "$PY" -m venv .venv
fi

key=$(
    {
        cat pyproject.toml scripts/bootstrap.sh
        .venv/bin/python --version
        echo "torch==$torch_version"
    } | sha256sum | cut -d' ' -f1
)
have_key="" have_extra=""
if [ -f "$stamp" ]; then
    read -r have_key have_extra <"$stamp" || true
fi

if [ "$have_key" = "$key" ] && { [ "$have_extra" = "$want" ] || [ "$have_extra" = dev ]; }; then
    say ".venv is up to date ($have_extra install; pyproject.toml unchanged): skipping pip"
    exit 0
fi

# Keep the dev extra once installed: a `make up` after `make test` must not leave a stamp that
# makes the next `make test` reinstall, and pip never uninstalls anyway.
extra=$want
[ "$have_extra" = dev ] && extra=dev
if [ "$extra" = dev ]; then
    target=".[dev]"
    say "installing torch $torch_version, the runtime dependencies and the test tools (pytest, hypothesis,"
    say "  transformers, triton, openai, ruff, nixl, ...; ~1.4 GB more on disk): about 30-60 s on 2 cores the first"
    say "  time when the wheels are local or in pip's cache, longer while they download"
else
    target="."
    say "installing torch $torch_version (CPU wheel, ~190 MB) and the runtime dependencies (~50 small"
    say "  packages: aiohttp, pydantic, tokenizers, gguf, textual, ...): about 20-45 s on 2 cores the first"
    say "  time when the wheels are local or in pip's cache, longer while they download"
fi
# --no-compile: pip would byte-compile every installed file (all of torch: ~25 s on 2 cores, most
# of it never imported); the warm-up below compiles only what serving imports.
find_links=()
[ -d /opt/wheels ] && find_links=(--find-links /opt/wheels)
t0=$SECONDS
.venv/bin/python -m pip install --disable-pip-version-check --no-compile "${find_links[@]}" \
    "torch==$torch_version" -e "$target" | { grep -v '^Requirement already satisfied' || true; }
say "pip done in $((SECONDS - t0)) s"

# Unset PYTHONDONTWRITEBYTECODE for this one import so the .pyc files get written even where the
# environment turns that off: without them every start recompiles torch's modules (~5-10 s).
t0=$SECONDS
say "byte-compiling the modules serving imports (about 10 s)"
if ! env -u PYTHONDONTWRITEBYTECODE .venv/bin/python -c "
import importlib, sys
for name in sys.argv[1:]:
    importlib.import_module(name)
" "${serving_modules[@]}"; then
    echo "[setup] error: the serving modules above do not import; the install is incomplete" >&2
    exit 1
fi
say "compiled in $((SECONDS - t0)) s"

echo "$key $extra" >"$stamp"
say "ready in $((SECONDS - start)) s ($extra install; the next run skips pip until pyproject.toml changes)"
