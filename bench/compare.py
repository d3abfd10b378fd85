#!/usr/bin/env python3
"""bench/compare: loop mode vs host mode vs HF transformers, isolated and under co-located CPU load.

The logic is blink_appliance/bench/compare.py (its docstring says what one run does); how to run
it on the GPU host and on a CPU machine is in docs/bench.md.
"""

import sys

from blink_appliance.bench.compare import main

if __name__ == "__main__":
    sys.exit(main())
