# Sourced by bench/*.sh at the start of a device call: the carried wheels and this tree installed,
# then the card named (every result says which GPU made it).
export PYTHONUNBUFFERED=1 PYTHONPATH=.
python3 -m pip install -q --no-deps .whl/*.whl >/dev/null 2>&1
# install DIR: put the tree at DIR in place (an editable install), as the A/B and stress scripts do in turn.
install() { (cd "$1" && python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1) || echo "install of $1 failed"; }
install .
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
