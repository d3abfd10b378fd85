"""The CPU reference engine: the spec the GPU loop follows, in plain PyTorch."""
