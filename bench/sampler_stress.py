"""The rejection sampler's queue kernel under many steps, looking for a step that never ends. One device call.

    PYTHONPATH=. python3 bench/sampler_stress.py [--steps 20000] [--rows 64] [--capacity 256]

Without a GPU it runs the same steps under the Triton interpreter (use a small --vocab): a check of
the harness and of the tokens, with no deadlines.

Each step draws new logits (N(0, scale) with a scale drawn per step; some steps rounded to bf16, whose
ties reach the rank rules; some peaked), moves every row's output index on, and runs the
rejection variant, interleaved with greedy steps as a serving loop mixes them. Every `--check` steps
the host waits for the GPU with a deadline. A step still running past it is reported with the queue's
counters and the rows' state, read on a stream of their own while the kernel spins (exit 3). Every
`--verify` steps the tokens are checked against the reference sampler (engine/reference/sampler.py).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

if not torch.cuda.is_available():  # a smoke run of the harness: interpreted, no deadlines, no timing
    os.environ["TRITON_INTERPRET"] = "1"

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_forward import _ensure_kernels_importable  # noqa: E402

_ensure_kernels_importable()

from blink_appliance.engine.loop.sampler import DeviceSampler  # noqa: E402
from blink_appliance.engine.reference.sampler import SamplingTensors, sample  # noqa: E402
from blink_appliance.wire.request import SamplingParams  # noqa: E402
from tests.test_device_sampler import make_state  # noqa: E402

MIXES = {
    "t0.7 top_p 0.9": dict(temperature=0.7, top_p=0.9),
    "t1.0": dict(temperature=1.0),
    "min_p 0.05": dict(temperature=0.8, min_p=0.05),
    "t0.7 top_p 0.9 min_p 0.05": dict(temperature=0.7, top_p=0.9, min_p=0.05),
    "t1.0 top_k 50": dict(temperature=1.0, top_k=50),
    "t0.8 top_k 5 min_p 0.05": dict(temperature=0.8, top_k=5, min_p=0.05),
    "t0.8 top_k 40 top_p 0.95": dict(temperature=0.8, top_k=40, top_p=0.95),
    "t0.7 top_k 20 top_p 0.8 min_p 0.05": dict(temperature=0.7, top_k=20, top_p=0.8, min_p=0.05),
}


def snapshot(sampler: DeviceSampler, rows: int) -> dict:
    """The queue's counters and the rows' state, copied on another stream (the kernel may still spin)."""
    st = sampler._rejection
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        got = {
            name: getattr(st, name)[: rows if name not in ("counters", "queue") else None].to(
                "cpu", non_blocking=True
            )
            for name in ("counters", "queue", "status", "arrived", "races")
        }
    side.synchronize()
    out = {name: t.tolist() for name, t in got.items()}
    out["counters"] = out["counters"][::32][:4]  # NEXT_TICKET, TAIL, SETTLED, OUT
    out["queue"] = [v for v in out["queue"] if v >= 0]
    return out


def set_rows(state, p: SamplingParams, step: int, n: int) -> None:
    """What schedule writes for the sample rows (as tests/test_device_sampler.load_rows, every row with
    p's settings and seed step * 131 + row), by fills on the GPU: no host copy waits on the stream."""
    state.row_temperature[:n].fill_(p.temperature)
    state.row_top_k[:n].fill_(p.top_k)
    state.row_top_p[:n].fill_(p.top_p)
    state.row_min_p[:n].fill_(p.min_p)
    state.row_seed[:n].copy_(torch.arange(n, device=state.row_seed.device) + step * 131)
    state.row_output_index[:n].fill_(step)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=20000)
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--capacity", type=int, default=256, help="the loop's max_seqs: sampler rows allocated")
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument(
        "--check",
        type=int,
        default=200,
        help="steps between waits on the GPU: 200 keeps it busy back to back, where the skip hung (the"
        " hang then ends by the caller's time limit: the host likely blocks on a full launch queue); a few (25) lets"
        " the harness report a hung step's queue, but there the skip did not hang",
    )
    ap.add_argument("--deadline-s", type=float, default=5.0)
    ap.add_argument(
        "--verify", type=int, default=200, help="steps between checks against the reference sampler"
    )
    ap.add_argument("--budget-s", type=float, default=120.0, help="stop starting steps after this")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    state = make_state(args.capacity, args.vocab)
    logits = torch.zeros(args.capacity, args.vocab, device=dev)
    sampler = DeviceSampler(state, logits)
    greedy = sampler.greedy
    gen = torch.Generator(device=dev).manual_seed(1)
    head = 16.0 - 1.5 * torch.log(torch.arange(1, args.vocab + 1, dtype=torch.float32, device=dev))
    mixes = list(MIXES)
    n = args.rows
    state.sample_slot[:n] = torch.arange(n, dtype=torch.int32, device=dev)
    state.num_sample_rows.fill_(n)
    t0 = time.monotonic()
    done, kinds, verified, mismatches = 0, {}, 0, 0
    for step in range(args.steps):
        if time.monotonic() - t0 > args.budget_s:
            break
        mix = mixes[step % len(mixes)]
        params = [SamplingParams(seed=step * 131 + r, max_tokens=1, **MIXES[mix]) for r in range(n)]
        set_rows(state, params[0], step, n)
        scale = float(torch.empty(1).uniform_(0.25, 4.0))
        logits[:n].normal_(0.0, scale, generator=gen)
        kind = ("bf16 " if step % 3 == 0 else "") + ("peaked" if step % 5 == 0 else "flat")
        if step % 5 == 0:
            logits[:n] += head[torch.randperm(args.vocab, device=dev, generator=gen)]
        if step % 3 == 0:
            logits.copy_(logits.bfloat16().float())
        # Each mix takes, a step each, every variant that serves it (the larger ones serve the smaller's rows).
        serving = (sampler.rejection, sampler.rejection_top_k, sampler.rejection_top_k_top_p)
        if "top_k" in MIXES[mix]:
            serving = serving[2:] if "top_p" in MIXES[mix] else serving[1:]
        rejection = serving[step % len(serving)]
        (greedy if step % 7 == 6 else rejection)()
        kinds[kind] = kinds.get(kind, 0) + 1
        if dev == "cpu":
            done = step + 1
        elif step % args.check == args.check - 1 or step % args.verify == 0:
            # Nothing above waits for the GPU (fills, no host copies), so a step that never ends is
            # seen here, and its state can still be read on another stream.
            event = torch.cuda.Event()
            event.record()
            deadline = time.monotonic() + args.deadline_s
            while not event.query():
                if time.monotonic() > deadline:
                    report = dict(step=step, mix=mix, kind=kind, scale=scale, state=snapshot(sampler, n))
                    print("HUNG", json.dumps(report)[:4000], flush=True)
                    if args.out:
                        args.out.write_text(json.dumps(report))
                    os._exit(3)  # a context with a spinning kernel may not tear down
                time.sleep(0.001)
            done = step + 1
        if step % args.verify == 0 and step % 7 != 6:
            tensors = SamplingTensors.build(params, [p.seed for p in params], [step] * n, "cpu")
            want = sample(logits[:n].cpu(), tensors)
            mismatches += int((state.sampled[:n].cpu() != want).sum())
            verified += 1
        if done % 2000 == 0 and done == step + 1:
            print(
                f"{done} steps, {time.monotonic() - t0:.1f} s, {mismatches} rows unlike the reference",
                flush=True,
            )
    if dev == "cuda":
        torch.cuda.synchronize()
    summary = dict(
        device=torch.cuda.get_device_name() if dev == "cuda" else "cpu (interpreted)", steps=done, seconds=round(time.monotonic() - t0, 1), kinds=kinds,
        verified_steps=verified, mismatched_rows=mismatches,
    )  # fmt: skip
    print(json.dumps(summary), flush=True)
    if args.out:
        args.out.write_text(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
