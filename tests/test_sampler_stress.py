"""The rejection sampler ends every step, many steps in a row (GPU only): bench/sampler_stress.py for a
few thousand steps of fresh logits, in a process of its own so that a step that never ends fails the
test at its time limit instead of hanging the suite. A branch on a value the program's threads did not
agree on hung it within 4,000 to 6,000 steps (bench/results/2026-11-28-h200-sampler-chunk-skip-and-probes.md),
which the one-step tests never saw."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="a stress of the GPU sampler; needs a CUDA GPU"
)


def test_the_rejection_sampler_ends_every_step_and_matches_the_reference(tmp_path):
    out = tmp_path / "stress.json"
    cmd = [sys.executable, str(ROOT / "bench" / "sampler_stress.py"), "--steps", "8000", "--budget-s", "90"]
    cmd += ["--verify", "400", "--out", str(out)]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    try:
        run = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"the sampler did not end a step within 240 s:\n{(e.stdout or '')[-2000:]}")
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    summary = json.loads(out.read_text())
    assert summary["steps"] >= 2000 and summary["verified_steps"] > 0, summary
    assert summary["mismatched_rows"] == 0, summary
