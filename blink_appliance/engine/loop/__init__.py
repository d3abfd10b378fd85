"""The GPU-resident loop: device state, the scheduler/sampler/commit kernels and the graph launched once."""
