"""How long the loop's schedule and commit kernels take to compile for the H100 (sm_90), per loop
geometry, on any machine (no GPU needed: Triton compiles to PTX and ptxas to a cubin here too).

    .venv/bin/python bench/compile_time.py [--geometries 8192/1024/256/2048 32768/4096/256/2048]

A geometry is max_model_len/num_slots/max_seqs/step budget, as bench/loop_profile.py and
bench/http_sweep.py take it. Both kernels are single programs vectorised over every slot, so their
compile time and their spills (".local" in the PTX) follow num_slots: this says whether a large
geometry's start-up is spent here. Prints one line per kernel and geometry.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)  # compile for the GPU target, not the interpreter
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from blink_appliance.kernels.commit import commit_kernel  # noqa: E402
from blink_appliance.kernels.schedule import schedule_kernel  # noqa: E402

from blink_appliance.engine.loop.commit import DeviceCommit  # noqa: E402
from blink_appliance.engine.loop.scheduler import DeviceScheduler  # noqa: E402
from blink_appliance.engine.loop.state import DeviceState, LoopGeometry  # noqa: E402
from blink_appliance.model.step_inputs import StepInputs  # noqa: E402
from blink_appliance.wire.ring_layout import RingGeometry, RingLayout  # noqa: E402
from tests.sm90_ptx import ptx_for_sm90  # noqa: E402

BUCKETS = (8, 32, 128, 512, 2048)


def geometries(spec: str) -> tuple[LoopGeometry, RingGeometry]:
    mml, slots, seqs, budget = (int(x) for x in spec.split("/"))
    loop = LoopGeometry(
        num_slots=slots, max_num_seqs=seqs, max_num_batched_tokens=budget,
        buckets=tuple(b for b in BUCKETS if b < budget) + (budget,), block_size=16,
        num_kv_blocks=max(seqs * mml // 16, 1), max_model_len=mml, max_stop_ids=16, vocab_size=128256,
        eos_token_ids=(128001,),
    )  # fmt: skip
    ring = RingGeometry(
        request_slots=slots, arena_tokens=slots * 1024, max_prompt_tokens=mml - 1, max_inflight=slots,
        max_output_tokens=mml - 1, max_stop_ids=16,
    )  # fmt: skip
    return loop, ring


def compile_both(spec: str) -> list[dict]:
    loop, ring_geometry = geometries(spec)
    layout = RingLayout.of(ring_geometry)
    ring = torch.zeros(layout.size, dtype=torch.uint8)
    state = DeviceState.allocate(loop, "cpu")
    inputs = StepInputs.allocate(
        loop.max_num_batched_tokens,
        loop.max_num_seqs,
        loop.max_blocks_per_seq,
        "cpu",
        loop.prompt_score_chunk,
    )
    sched = DeviceScheduler(loop, state, ring, layout, inputs, 1)
    commit = DeviceCommit(loop, state, ring, layout)
    out = []
    for name, kernel, args, constants, warps in (
        ("schedule", schedule_kernel, sched._args, sched._constants, sched.num_warps),
        ("commit", commit_kernel, commit._args, commit._constexprs, 4),
    ):
        t0 = time.monotonic()
        ptx = ptx_for_sm90(
            kernel, args, constants, num_warps=warps, scalar="i64" if name == "schedule" else "i32"
        )
        out.append({
            "geometry": spec, "kernel": name, "compile_s": round(time.monotonic() - t0, 1),
            "ptx_lines": ptx.count("\n"), "local_refs": ptx.count(".local"),
        })  # fmt: skip
        print(json.dumps(out[-1]), flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--geometries", nargs="+", default=["512/64/64/512", "8192/1024/256/2048", "32768/4096/256/2048"]
    )
    ap.add_argument("--out", type=Path, default=None, help="JSON file for the rows")
    args = ap.parse_args()
    rows = [row for spec in args.geometries for row in compile_both(spec)]
    if args.out is not None:
        args.out.write_text(json.dumps({"geometries": args.geometries, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
