"""GPU kernels: Triton (.py) and CUDA C (.cu, compiled at run time with NVRTC). Installed as blink_appliance.kernels."""
