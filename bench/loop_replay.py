"""Replay one saved loop iteration on the CPU (Triton interpreter) and compare with the GPU's result.

bench/loop_stress.py saves, for the first host-driven step that leaves the loop's bookkeeping
inconsistent, the DeviceState and ring bytes before the step and the state after it. This runs the
same schedule and commit kernels from that state (commit reads the GPU's `sampled` tokens, so the
forward is not needed) and prints every state tensor whose CPU result differs from the GPU's:

    TRITON_INTERPRET=1 .venv/bin/python bench/loop_replay.py kv_bad_step.pt
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "1"
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from blink_appliance.engine.loop.commit import DeviceCommit  # noqa: E402
from blink_appliance.engine.loop.scheduler import DeviceScheduler  # noqa: E402
from blink_appliance.engine.loop.state import DeviceState  # noqa: E402
from blink_appliance.model.step_inputs import StepInputs  # noqa: E402
from blink_appliance.wire.ring_layout import RingLayout  # noqa: E402

sys.path.insert(0, str(ROOT / "bench"))
from loop_stress import RING, geometry  # noqa: E402


def main() -> None:
    saved = torch.load(sys.argv[1], weights_only=False)
    before, after = saved["state"], saved["after"]["state"]
    vocab = int(sys.argv[2]) if len(sys.argv) > 2 else 512
    g = geometry(vocab, (2,), before["free_blocks"].numel())
    state = DeviceState.allocate(g, "cpu")
    for name, t in state.tensors().items():
        t.copy_(before[name])
    ring = torch.frombuffer(bytearray(saved["ring"]), dtype=torch.uint8)
    inputs = StepInputs.allocate(
        g.max_num_batched_tokens, g.max_num_seqs, g.max_blocks_per_seq, "cpu", g.prompt_score_chunk
    )
    DeviceScheduler(g, state, ring, RingLayout.of(RING), inputs, engine_seed=7).launch()
    print("schedule on the CPU: step_slot", state.step_slot.tolist())
    state.sampled.copy_(after["sampled"])
    DeviceCommit(g, state, ring, RingLayout.of(RING)).launch()
    for name, t in state.tensors().items():
        if name in ("clock_offset_ns",):
            continue
        if not torch.equal(t, after[name]):
            diff = (t != after[name]).nonzero().tolist()[:10]
            print(f"{name}: differs at {diff}; cpu {t.flatten()[:0].tolist()}")
            for idx in diff[:6]:
                print("   ", idx, "cpu", t[tuple(idx)].item(), "gpu", after[name][tuple(idx)].item())
    print("cpu problems:", state.problems())


if __name__ == "__main__":
    main()
