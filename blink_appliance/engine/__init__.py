"""Engines: the CPU reference engine (the spec) and, with a GPU, the device-resident loop."""
