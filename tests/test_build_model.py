"""build_model stays off torch's Python refs: they import torch._dynamo, torch.fx and sympy, seconds of
every engine start."""

from __future__ import annotations

import subprocess
import sys

HEAVY = ("torch._dynamo", "torch.fx.experimental.symbolic_shapes", "sympy")


def test_building_a_model_imports_no_compiler_stack():
    code = (
        "import sys\n"
        "from blink_appliance.model.loaders import build_model, load_checkpoint\n"
        "model = build_model(load_checkpoint('dummy:tiny', seed=1))\n"
        "assert model.model.embed_tokens.weight.device.type == 'cpu'\n"
        f"print(sorted(m for m in {HEAVY!r} if m in sys.modules))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True
    )
    assert out.stdout.strip() == "[]", f"building a model imported {out.stdout.strip()}"
