# Sourced by the tensor-parallel device scripts (tp_check.sh, tp_probe.sh, tp_loop.sh) with their
# OUT_DIR argument: the environment they run in, the tree installed over the carried wheels (.whl/),
# and the GPUs named. Every module is loaded when the context starts, not at a kernel's first launch.
export CUDA_MODULE_LOADING=EAGER PYTHONUNBUFFERED=1 PYTHONPATH=.
out=${1:?OUT_DIR}
mkdir -p "$out"
python3 -m pip install -q --no-deps .whl/*.whl && python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null || exit 1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
