# Sourced by bench/*_ab.sh at the start of a device call: the carried wheels installed, the base tree
# (`git archive --format=tar.gz -o .whl/base.tar.gz <base commit>`) unpacked in /tmp/base, `install DIR`
# to put either tree in place in turn, and the card named (every result says which GPU made it).
here=$PWD
export PYTHONUNBUFFERED=1
install() { (cd "$1" && python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1) || echo "install of $1 failed"; }
python3 -m pip install -q --no-deps .whl/*.whl >/dev/null 2>&1
rm -rf /tmp/base && mkdir -p /tmp/base && tar xzf .whl/base.tar.gz -C /tmp/base
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
