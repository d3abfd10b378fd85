"""The engine process's CPU pinning (blink_appliance/engine/process.py, `appliance.engine_cpus`)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from blink_appliance.processes import pin_cpus
from blink_appliance.profile import ProfileError


def test_pinning_sizes_torch_threads_to_the_pinned_cpus():
    """torch sizes its thread pool when it is imported, before the engine pins itself: pinned to one
    CPU it must run one thread, not one per CPU of the host taking turns on it. In a child process:
    affinity and torch's pool are process-wide."""
    cpu = min(os.sched_getaffinity(0))
    code = (
        "import os, torch\n"
        "from blink_appliance.processes import pin_cpus\n"
        "torch.set_num_threads(2)  # what import gives on a 2-CPU host, whatever this host has\n"
        f"pin_cpus([{cpu}], 'appliance.engine_cpus')\n"
        "print(torch.get_num_threads(), sorted(os.sched_getaffinity(0)))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split(maxsplit=1) == ["1", f"[{cpu}]\n"], done.stdout


def test_a_cpu_list_the_host_cannot_take_names_the_key():
    with pytest.raises(ProfileError, match=r"appliance.engine_cpus: cannot pin to CPUs \[100000\]"):
        pin_cpus([100000], "appliance.engine_cpus", ProfileError)


@pytest.mark.parametrize(
    "args, message",
    [
        ([], "the profile has 2 models, an engine process each; pass --model"),
        (["--model", "2"], "--model 2: the profile has 2 models"),
    ],
)
def test_an_engine_process_serves_one_named_model_of_several(tmp_path, args, message):
    profile = tmp_path / "two.toml"
    model = 'source = "dummy:tiny"\nkv_budget_gib = 0.01\n'
    profile.write_text(f'[[models]]\nname = "a"\n{model}\n[[models]]\nname = "b"\n{model}')
    done = subprocess.run(
        [sys.executable, "-m", "blink_appliance.engine.process", str(profile), *args],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 2 and message in done.stderr
