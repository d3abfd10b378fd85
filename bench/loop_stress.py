"""The GPU loop under load, one device call: KV bookkeeping at batch 64, then the survival soak.

    python3 -m pip install -q --no-deps .whl/*.whl && python3 -m pip install -q --no-deps --no-build-isolation -e .
    PYTHONUNBUFFERED=1 python3 bench/loop_stress.py --out $OUT

Everything runs in this process (bench/loop_rig.py): the loop over a mapped shared-memory ring and
an EngineClient on the same ring, `dummy:tiny` fp32 unless --model says otherwise.

1. kv-host / kv-loop: 64 greedy requests at once (16-token prompts, --tokens each) in the geometry
   of bench/loop_cpu_time.py's batch-64 run. Host-driven, the KV free list and block tables are
   checked after every step (DeviceState.problems); the first bad step's input state and
   ring bytes are saved to $OUT/kv_bad_step.pt for a CPU replay. In the loop, free_top is watched
   while it runs and everything is checked after shutdown.
2. soak: --requests requests through the device loop in bursts with idle gaps; mixed prompt
   lengths, max_tokens, seeded sampling; a cancel storm (every --cancel-every-th request cancelled
   right after submission or after its first token); bursts larger than the request ring, so
   submissions meet a full ring (EngineBusyError) and retry. Every request must end with exactly one
   terminal event; then shutdown must return within a second and every block must be back.
3. smollm2-bf16: SmolLM2-shaped random weights in bf16 in the device loop, prompts of mixed lengths,
   half arriving while the others decode: greedy streams against the CPU reference engine (fp32, the
   same weights) on the leading tokens, and a seeded sampled workload run in two fresh loops.
Extra phases for chasing a loop bug: kv-loop-presubmit (records in the ring before the launch),
kv-loop-checked (Tripwire below), --trickle (arrivals spread over the run instead of 64 at once).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.loop_rig import LoopRig  # noqa: E402
from blink_appliance.engine.loop.control import LoopControl  # noqa: E402
from blink_appliance.engine.loop.graph import DeviceLoop  # noqa: E402
from blink_appliance.engine.loop.mapped_region import RingWords  # noqa: E402
from blink_appliance.engine.loop.state import COUNTER_INDEX, LoopGeometry  # noqa: E402
from blink_appliance.engine.reference.engine import EngineConfig, LLMEngine  # noqa: E402
from blink_appliance.model.loaders import build_model, load_checkpoint  # noqa: E402
from blink_appliance.wire.client import EngineBusyError  # noqa: E402
from blink_appliance.wire.request import FinishReason, Request, SamplingParams  # noqa: E402
from blink_appliance.wire.ring_layout import EngineState, RingGeometry  # noqa: E402

PROMPT = 16


def geometry(vocab: int, eos: tuple[int, ...], num_kv_blocks: int) -> LoopGeometry:
    return LoopGeometry(
        num_slots=128, max_num_seqs=64, max_num_batched_tokens=512, buckets=(8, 32, 128, 512),
        block_size=16, num_kv_blocks=num_kv_blocks, max_model_len=1024, max_stop_ids=4,
        vocab_size=vocab, eos_token_ids=eos,
    )  # fmt: skip


RING = RingGeometry(
    request_slots=64,
    arena_tokens=16384,
    max_prompt_tokens=256,
    max_inflight=128,
    max_output_tokens=512,
    max_stop_ids=4,
)


def prompt(i: int, n: int, vocab: int) -> list[int]:
    return [(i * 37 + j * 11) % (vocab - 3) + 3 for j in range(n)]


class Tripwire:
    """Debug launches around the loop's iteration (kv-loop-checked): `save` copies the KV-relevant
    state first, `check` (after commit, before the WHILE condition is handed over) counts every block
    id in the free stack and the held tables; any id not held exactly once, a free_top out of range or
    a FREE/WAITING slot holding blocks sets `tripped` and drops keep_running, so the loop ends right
    after the first bad iteration with the state from before it kept in `shadow`."""

    NAMES = (
        "slot_state", "chan", "generation", "request_id", "prompt_len", "num_tokens", "num_computed",
        "max_tokens", "num_blocks", "block_table", "free_blocks", "free_top", "run_order", "step_slot",
        "step_chunk", "sample_slot", "counters",
    )  # fmt: skip

    def __init__(self, state) -> None:
        self.state = state
        self.shadow = {n: getattr(state, n).clone() for n in self.NAMES}
        dev = state.free_top.device
        n = state.free_blocks.numel()
        self.n = n
        self.positions = torch.arange(n, device=dev)
        self.columns = torch.arange(state.block_table.shape[1], device=dev)
        self.counts = torch.zeros(n + 1, dtype=torch.int32, device=dev)
        self.ones_free = torch.ones(n, dtype=torch.int32, device=dev)
        self.ones_held = torch.ones(state.block_table.numel(), dtype=torch.int32, device=dev)
        self.tripped = torch.zeros(1, dtype=torch.int32, device=dev)

    def save(self) -> None:
        for name, copy in self.shadow.items():
            copy.copy_(getattr(self.state, name))

    def check(self) -> None:
        st, n = self.state, self.n
        self.counts.zero_()
        free = torch.where(self.positions < st.free_top, st.free_blocks.long(), n).clamp(0, n)
        self.counts.index_add_(0, free, self.ones_free)
        held = self.columns[None, :] < st.num_blocks[:, None]
        table = torch.where(held, st.block_table.long(), n).clamp(0, n).flatten()
        self.counts.index_add_(0, table, self.ones_held)
        bad = (
            (self.counts[:n] != 1).any()
            | (st.free_top[0] > n)
            | (st.free_top[0] < 0)
            | ((st.num_blocks > 0) & (st.slot_state <= 1)).any()
        )
        self.tripped.copy_(torch.maximum(self.tripped, bad.int()))
        st.keep_running.mul_(1 - self.tripped)


def snapshot(rig: LoopRig) -> dict:
    return {
        "state": {k: v.detach().cpu().clone() for k, v in rig.step.state.tensors().items()},
        "ring": bytes(rig.transport.buffer),
    }


async def kv_run(
    rig: LoopRig,
    tokens: int,
    vocab: int,
    out: Path | None,
    presubmit: bool,
    tripwire: Tripwire | None = None,
    trickle: bool = False,
) -> dict:
    """`presubmit`: all 64 records are in the ring before the loop starts (none arrives while the
    schedule kernel reads the ring), else they are submitted once it runs."""
    client = rig.client()
    await client.start()
    streams: dict[int, list] = {}

    async def collect(rid: int) -> None:
        async for event in client.stream(rid):
            streams[rid].append(event)

    if presubmit:
        rig.heartbeat()
        rig.region.store("engine_state", EngineState.RUNNING)
    else:
        rig.start()
    tasks = []
    submitted = 0

    def submit(k: int) -> None:
        nonlocal submitted
        for _ in range(min(k, 64 - submitted)):
            params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
            rid = client.submit(prompt(submitted, PROMPT, vocab), params)
            streams[rid] = []
            tasks.append(asyncio.create_task(collect(rid)))
            submitted += 1

    rng = random.Random(1)
    submit(64 if not trickle else 0)
    if presubmit:
        rig.start()
    trace: list[tuple] = []
    host = rig.loop is None
    steps, problems, max_top = 0, [], 0
    deadline = time.monotonic() + 120
    state = rig.step.state
    while (submitted < 64 or not all(t.done() for t in tasks)) and time.monotonic() < deadline:
        if trickle:
            rig.heartbeat()
            submit(rng.choice([0, 0, 1, 1, 2, 3]))
        if host:
            before = snapshot(rig) if out is not None else None
            rig.beat()
            steps += 1
            problems = state.problems()
            if problems:
                if before is not None:
                    torch.save({"step": steps, **before, "after": snapshot(rig)}, out / "kv_bad_step.pt")
                break
        else:
            try:
                rig.beat()
            except RuntimeError:  # the loop ended by itself: the tripwire (or a loop failure)
                problems = [f"loop ended by itself after iteration {int(state.counters[0])}"]
                break
            top = int(state.free_top[0])  # plain reads beside the running graph
            trace.append((top, int(state.num_active[0]), *state.counters[:5].tolist()))
            max_top = max(max_top, top)
            if max_top > state.free_blocks.numel():
                problems = [f"free_top {max_top} past {state.free_blocks.numel()} while running"]
                break
        await asyncio.sleep(0.0002 if host else 0.001)
    stop_s = rig.stop() if rig.loop is None or rig.loop.running() else 0.0
    for t in tasks:
        t.cancel()
    await client.close()
    problems = problems or state.problems()
    if tripwire is not None and int(tripwire.tripped[0]) and out is not None:
        torch.save(
            {"before": {k: v.cpu() for k, v in tripwire.shadow.items()}, **snapshot(rig)},
            out / "kv_tripped.pt",
        )
        problems.append("tripwire: " + "; ".join(state.problems()))
    lengths = [sum(e.token_id is not None for e in ev) for ev in streams.values()]
    finished = [sum(e.finished for e in ev) for ev in streams.values()]
    return {
        "steps": steps,
        "problems": problems,
        "tokens_per_request": sorted(set(lengths)),
        "terminal_events": sorted(set(finished)),
        "free_top": int(state.free_top[0]),
        "num_active": int(state.num_active[0]),
        "stop_s": round(stop_s, 4),
        "trace_tail": trace[-12:] if problems else [],
    }


async def soak(rig: LoopRig, args: argparse.Namespace, vocab: int) -> dict:
    client = rig.client()
    await client.start()
    rng = random.Random(0)
    events: dict[int, list] = {}
    cancel_first: set[int] = set()
    busy = 0

    async def collect(rid: int) -> None:
        async for event in client.stream(rid):
            events[rid].append(event)
            if rid in cancel_first and event.token_id is not None:
                cancel_first.discard(rid)
                client.cancel(rid)

    rig.start()
    tasks = []
    submitted = 0
    t0 = time.monotonic()
    while submitted < args.requests:
        burst = min(rng.randint(50, 400), args.requests - submitted)
        for _ in range(burst):
            i = submitted
            params = SamplingParams(
                max_tokens=rng.randint(1, 24),
                ignore_eos=True,
                **({"temperature": 0.8, "top_k": 50, "seed": i} if i % 3 == 0 else {"temperature": 0.0}),
            )
            while True:
                rig.beat()
                try:
                    rid = client.submit(prompt(i, rng.randint(1, 200), vocab), params)
                    break
                except EngineBusyError:
                    busy += 1
                    await asyncio.sleep(0.0005)
            events[rid] = []
            tasks.append(asyncio.create_task(collect(rid)))
            if i % args.cancel_every == 0:
                client.cancel(rid)
            elif i % args.cancel_every == 1:
                cancel_first.add(rid)
            submitted += 1
        while len(tasks := [t for t in tasks if not t.done()]) > 32:  # most of the burst drains, then idle
            rig.beat()
            await asyncio.sleep(0.002)
        await asyncio.sleep(rng.choice([0.0, 0.05, 0.3]))
    deadline = time.monotonic() + 120
    while not all(t.done() for t in tasks) and time.monotonic() < deadline:
        rig.beat()
        await asyncio.sleep(0.002)
    elapsed = time.monotonic() - t0
    stop_s = rig.stop()
    await client.close()
    state = rig.step.state
    terminal = [sum(e.finished for e in ev) for ev in events.values()]
    reasons: dict[str, int] = {}
    for ev in events.values():
        if ev and ev[-1].finished:
            key = ev[-1].finish_reason.name if ev[-1].finish_reason else "?"
            reasons[key] = reasons.get(key, 0) + 1
    counters = state.counters.cpu().tolist()
    return {
        "requests": len(events),
        "seconds": round(elapsed, 1),
        "exactly_one_terminal": sum(t == 1 for t in terminal),
        "not_finished": sum(t == 0 for t in terminal),
        "finish_reasons": reasons,
        "ring_full_retries": busy,
        "generated_tokens": counters[COUNTER_INDEX["generated_tokens"]],
        "preemptions": counters[COUNTER_INDEX["preemptions"]],
        "loop_iterations": counters[COUNTER_INDEX["loop_iterations"]],
        "problems": state.problems(),
        "num_active": int(state.num_active[0]),
        "stop_s": round(stop_s, 4),
        "aborted": reasons.get(FinishReason.ABORT.name, 0),
    }


SMOL_PROMPTS = (3, 9, 17, 33, 64, 100, 5, 250)  # prompt lengths; the last four arrive while the first decode


async def serve_small(rig: LoopRig, vocab: int, params: SamplingParams, arrivals: bool) -> list[list[int]]:
    """SMOL_PROMPTS through the running loop; with `arrivals` half of them arrive once the first has 2
    tokens (the batches then depend on timing), else all are in the ring before the launch."""
    client = rig.client()
    await client.start()
    streams: list[list] = [[] for _ in SMOL_PROMPTS]

    async def collect(rid: int, into: list) -> None:
        async for event in client.stream(rid):
            into.append(event)

    if arrivals:
        rig.start()
    else:
        rig.heartbeat()
        rig.region.store("engine_state", EngineState.RUNNING)
    tasks = []
    for i, n in enumerate(SMOL_PROMPTS):
        if i == 4 and arrivals:
            while len(streams[0]) < 2:
                rig.beat()
                await asyncio.sleep(0.0005)
        rig.heartbeat()
        tasks.append(asyncio.create_task(collect(client.submit(prompt(i, n, vocab), params), streams[i])))
    if not arrivals:
        rig.start()
    while not all(t.done() for t in tasks):
        rig.beat()
        await asyncio.sleep(0.001)
    rig.stop()
    await client.close()
    assert all(sum(e.finished for e in s) == 1 for s in streams)
    return [[e.token_id for e in s if e.token_id is not None] for s in streams]


def smollm2_bf16(args: argparse.Namespace) -> dict:
    """SmolLM2-shaped random weights in bf16 through the device loop: greedy streams (half the requests
    arriving mid-run) against the CPU reference engine (fp32, the same weights) on the first tokens,
    and seeded sampled streams of two separate loops (fresh state each, the same requests queued
    before the launch, so the batches are the same) against each other."""
    ckpt = load_checkpoint("dummy:smollm2-135m", seed=0)
    cfg = ckpt.config
    g = geometry(cfg.vocab_size, tuple(cfg.eos_token_ids)[:8], args.num_kv_blocks)
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    sampled = SamplingParams(max_tokens=8, ignore_eos=True, temperature=0.8, top_k=40, top_p=0.9, seed=11)
    runs = {}
    for name, params in (("greedy", greedy), ("sampled-1", sampled), ("sampled-2", sampled)):
        rig = LoopRig.build(RING, g, checkpoint=ckpt, dtype=torch.bfloat16, device="cuda", in_loop=True)
        try:
            runs[name] = asyncio.run(serve_small(rig, cfg.vocab_size, params, arrivals=name == "greedy"))
            problems = rig.step.state.problems()
        finally:
            rig.close()
        assert problems == [], problems
    model = build_model(ckpt, torch.float32, "cpu")
    config = EngineConfig(block_size=16, num_kv_blocks=256, max_num_seqs=8, max_model_len=1024, seed=0)
    reference = [
        LLMEngine(model, config).generate([Request(0, prompt(i, n, cfg.vocab_size), greedy)])[0]
        for i, n in enumerate(SMOL_PROMPTS)
    ]
    leading = []
    for got, want in zip(runs["greedy"], reference, strict=True):
        k = 0
        while k < len(want) and k < len(got) and got[k] == want[k]:
            k += 1
        leading.append(k)
    return {
        "prompt_lengths": list(SMOL_PROMPTS),
        "greedy_leading_tokens_equal_to_fp32_reference": leading,
        "first_token_equal": sum(k >= 1 for k in leading),
        "first_4_tokens_equal": sum(k >= 4 for k in leading),
        "sampled_equal_run_to_run": runs["sampled-1"] == runs["sampled-2"],
        "sampled_differs_from_greedy": runs["sampled-1"] != runs["greedy"],
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="dummy:tiny")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--tokens", type=int, default=160)
    ap.add_argument("--num-kv-blocks", type=int, default=2048)
    ap.add_argument("--requests", type=int, default=10_000)
    ap.add_argument("--cancel-every", type=int, default=10)
    ap.add_argument(
        "--phases",
        nargs="+",
        default=["kv-host", "kv-loop", "soak", "smollm2-bf16"],
        help="kv-host, kv-loop, kv-loop-presubmit, kv-loop-checked, soak, smollm2-bf16",
    )
    ap.add_argument(
        "--trickle", action="store_true", help="kv phases: 0-3 arrivals per host tick, not 64 at once"
    )
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    ckpt = load_checkpoint(args.model, seed=0)
    cfg = ckpt.config
    g = geometry(cfg.vocab_size, tuple(cfg.eos_token_ids)[:8], args.num_kv_blocks)
    dtype = getattr(torch, args.dtype)
    results = {}
    for phase in args.phases:
        t0 = time.monotonic()
        if phase == "smollm2-bf16":
            results[phase] = smollm2_bf16(args)
            results[phase]["wall_s"] = round(time.monotonic() - t0, 1)
            print(phase, json.dumps(results[phase]), flush=True)
            continue
        checked = phase == "kv-loop-checked"
        in_loop = phase not in ("kv-host", "kv-loop-checked")
        rig = LoopRig.build(RING, g, checkpoint=ckpt, dtype=dtype, device="cuda", in_loop=in_loop)
        tripwire = None
        if checked:
            tripwire = Tripwire(rig.step.state)
            rig.loop = DeviceLoop(
                [tripwire.save, *rig.step.body(), tripwire.check], num_active=rig.step.state.num_active,
                keep_running=rig.step.state.keep_running, ring=RingWords.of(rig.mapped),
                control=LoopControl(rig.step.state.num_active.device),
            )  # fmt: skip
        try:
            if phase.startswith("kv"):
                presubmit = phase.endswith("presubmit")
                results[phase] = asyncio.run(
                    kv_run(rig, args.tokens, cfg.vocab_size, args.out, presubmit, tripwire, args.trickle)
                )
            else:
                results[phase] = asyncio.run(soak(rig, args, cfg.vocab_size))
        finally:
            if rig.loop is not None and rig.loop.running():
                rig.loop.stop(5.0)
            rig.close()
        results[phase]["wall_s"] = round(time.monotonic() - t0, 1)
        print(phase, json.dumps(results[phase]), flush=True)
    if args.out is not None:
        (args.out / "loop_stress.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
