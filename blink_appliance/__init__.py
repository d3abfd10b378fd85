"""blink-appliance: an LLM serving appliance whose token loop runs on the GPU, not the host CPU."""

__version__ = "0.1.0"
