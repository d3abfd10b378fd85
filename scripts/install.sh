#!/usr/bin/env bash
# Install blink-appliance as a system service (docs/install.md). Idempotent: run it again to upgrade.
#
#   sudo scripts/install.sh [--profile FILE] [--gpu] [--torch-index URL] [--prefix DIR]
#   scripts/install.sh --root DIR [...]     stage every file under DIR instead of / (for a test
#                                           or an image build; no systemctl, no chown)
#
# What it does, each step skipped when already done:
#   1. the system user and group `blink` (home /var/lib/blink-appliance, no login shell);
#   2. a venv at PREFIX/.venv (default /opt/blink-appliance), owned by root so the service cannot
#      change its own code, with torch pinned first (an open range pulls a multi-GB CUDA build),
#      then the package with what serving needs (plus the gpu extra with --gpu), no test tools;
#   3. the docs under PREFIX/docs (the units' Documentation=);
#   4. the units into /etc/systemd/system (replaced when the shipped ones changed; the old file is
#      kept as NAME.bak; local settings belong in drop-ins: systemctl edit blink-appliance);
#   5. the profile at /etc/blink-appliance/profile.toml, only when there is none (root:blink 0640:
#      it may hold API keys);
#   6. the cache and state directories, so a model can be pulled before the first start.
set -euo pipefail
umask 022

SRC=$(cd "$(dirname "$0")/.." && pwd)
ROOT=""
PREFIX=/opt/blink-appliance
PROFILE="$SRC/profiles/default.toml"
EXTRAS=""
TORCH_INDEX=""
MAKE_VENV=1
SERVICE_USER=blink
STATE_DIR=/var/lib/blink-appliance
CACHE_DIR=/var/cache/blink-appliance
TORCH_VERSION=${BLINK_TORCH_VERSION:-2.13.0}
PY=${PYTHON:-python3}

usage() {
    sed -n '2,6p' "$0" | sed 's/^# \{0,1\}//'
    cat <<'EOF'
options:
  --profile FILE      profile to install when /etc/blink-appliance/profile.toml is absent
                      (default profiles/default.toml; a GPU host: profiles/gpu-h100.example.toml)
  --gpu               also install the gpu extra (cupy, cuda-bindings, nvidia-ml-py)
  --torch-index URL   pip index for torch alone, e.g. https://download.pytorch.org/whl/cpu on a
                      CPU-only host (PyPI's torch for Linux is the CUDA build)
  --prefix DIR        install root of the venv and docs (default /opt/blink-appliance; the units
                      are rewritten to match)
  --root DIR          stage under DIR: DIR/etc/..., DIR/opt/...; the user is added to
                      DIR/etc/passwd (useradd --prefix) when that file exists, skipped otherwise
  --no-venv           skip step 2 (the venv and pip)
EOF
}

die() {
    echo "install.sh: $*" >&2
    exit 2
}
step() { echo "[install] $*"; }

while [ $# -gt 0 ]; do
    case "$1" in
    --profile) PROFILE=${2:?--profile needs a file}; shift 2 ;;
    --gpu) EXTRAS="[gpu]"; shift ;;
    --torch-index) TORCH_INDEX=${2:?--torch-index needs a URL}; shift 2 ;;
    --prefix) PREFIX=${2:?--prefix needs a directory}; shift 2 ;;
    --root) ROOT=${2:?--root needs a directory}; shift 2 ;;
    --no-venv) MAKE_VENV=0; shift ;;
    -h | --help) usage; exit 0 ;;
    *) usage >&2; die "unknown option: $1" ;;
    esac
done

case "$PREFIX" in /*) ;; *) die "--prefix must be an absolute path: $PREFIX" ;; esac
[ -f "$PROFILE" ] || die "no profile at $PROFILE"
if [ -n "$ROOT" ]; then
    mkdir -p "$ROOT"
    ROOT=$(cd "$ROOT" && pwd)
    [ "$ROOT" != / ] || die "--root / is the real system; leave --root out"
elif [ "$(id -u)" -ne 0 ]; then
    die "run as root (sudo), or stage into a directory with --root DIR"
fi

# 1. The service user. In a staged root, only when it has an /etc/passwd to add to.
if [ -z "$ROOT" ]; then
    if getent passwd "$SERVICE_USER" >/dev/null; then
        step "user $SERVICE_USER exists"
    else
        step "adding system user $SERVICE_USER"
        useradd --system --user-group --home-dir "$STATE_DIR" --no-create-home \
            --shell /usr/sbin/nologin --comment "blink-appliance" "$SERVICE_USER"
    fi
elif [ -f "$ROOT/etc/passwd" ]; then
    if grep -q "^$SERVICE_USER:" "$ROOT/etc/passwd"; then
        step "user $SERVICE_USER exists in $ROOT/etc/passwd"
    else
        step "adding system user $SERVICE_USER to $ROOT/etc/passwd"
        useradd --prefix "$ROOT" --system --user-group --home-dir "$STATE_DIR" --no-create-home \
            --shell /usr/sbin/nologin --comment "blink-appliance" "$SERVICE_USER"
    fi
else
    step "no $ROOT/etc/passwd: not adding user $SERVICE_USER"
fi

# 2. The venv: serving packages only. pip prints its progress; a rerun finds torch satisfied.
VENV="$ROOT$PREFIX/.venv"
if [ "$MAKE_VENV" = 1 ]; then
    if [ ! -x "$VENV/bin/python" ]; then
        step "creating $VENV"
        mkdir -p "$ROOT$PREFIX"
        "$PY" -m venv "$VENV" || die "$PY -m venv failed (Debian/Ubuntu: apt-get install python3-venv)"
    fi
    pip=("$VENV/bin/python" -m pip install --disable-pip-version-check)
    [ -d /opt/wheels ] && pip+=(--find-links /opt/wheels)
    torch_index=()
    [ -n "$TORCH_INDEX" ] && torch_index=(--index-url "$TORCH_INDEX")
    step "torch==$TORCH_VERSION"
    "${pip[@]}" "${torch_index[@]}" "torch==$TORCH_VERSION"
    step "blink-appliance$EXTRAS from $SRC"
    "${pip[@]}" "$SRC$EXTRAS"
else
    step "--no-venv: leaving $VENV alone"
fi

# 3. Docs, for the units' Documentation= lines.
mkdir -p "$ROOT$PREFIX/docs"
cp -R "$SRC/docs/." "$ROOT$PREFIX/docs/"

# 4. Units: the shipped ones, with the prefix rewritten when it is not the default.
UNIT_DIR="$ROOT/etc/systemd/system"
mkdir -p "$UNIT_DIR"
for unit in "$SRC"/systemd/*.service; do
    name=$(basename "$unit")
    new=$(mktemp)
    sed "s#/opt/blink-appliance#$PREFIX#g" "$unit" >"$new"
    if [ ! -f "$UNIT_DIR/$name" ]; then
        step "unit $UNIT_DIR/$name"
    elif cmp -s "$new" "$UNIT_DIR/$name"; then
        step "unit $UNIT_DIR/$name is current"
        rm -f "$new"
        continue
    else
        step "unit $UNIT_DIR/$name updated (the old one is $name.bak)"
        cp -p "$UNIT_DIR/$name" "$UNIT_DIR/$name.bak"
    fi
    install -m 0644 "$new" "$UNIT_DIR/$name"
    rm -f "$new"
done

# 5. The profile: never overwritten, the operator owns it once it is there.
ETC="$ROOT/etc/blink-appliance"
mkdir -p "$ETC"
if [ -f "$ETC/profile.toml" ]; then
    step "profile $ETC/profile.toml exists; left as it is"
else
    step "profile $ETC/profile.toml (from $PROFILE)"
    install -m 0640 "$PROFILE" "$ETC/profile.toml"
    if [ -z "$ROOT" ]; then chgrp "$SERVICE_USER" "$ETC/profile.toml"; fi
fi

# 6. Cache and state directories (systemd creates them too, at the first start).
for dir in "$CACHE_DIR" "$STATE_DIR"; do
    mkdir -p "$ROOT$dir"
    chmod 0750 "$ROOT$dir"
    if [ -z "$ROOT" ]; then chown "$SERVICE_USER:$SERVICE_USER" "$ROOT$dir"; fi
done

if [ -z "$ROOT" ] && [ -d /run/systemd/system ]; then
    systemctl daemon-reload
fi
cat <<EOF
[install] done. Next:
  edit $ETC/profile.toml (docs/profile.md), then
  sudo -u $SERVICE_USER env BLINK_APPLIANCE_CACHE=$CACHE_DIR $PREFIX/.venv/bin/blink-appliance check $ETC/profile.toml
  systemctl enable --now blink-appliance
EOF
