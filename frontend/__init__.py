"""The front end: OpenAI-compatible HTTP, tokenization, ring writer. Runs on the host or a DPU. Installed as blink_appliance.frontend."""
