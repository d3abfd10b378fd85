"""LoopStep end to end on the CPU: the front end's EngineClient submits into a real shared ring, the
loop's kernels (schedule, sample, commit: Triton under the interpreter) serve it one host_step() at a
time, and the streams must equal the CPU reference engine's for the same weights and the same
EngineConfig numbers: greedy ones, and seeded sampled ones.

The forward: the interpreted Triton forward (GpuForward) takes ~20 s per step on the CPU, so the
mixed workload runs the loop around `ReferenceStepForward`, the reference model reading the same
StepInputs and writing the same logits buffer (GpuForward's interface; test_gpu_forward.py checks the
two forwards agree). A slow test runs a short workload through LoopStep.build's real GpuForward.

The workload mixes prompt lengths (one longer than the step budget, so it is chunked), arrivals while
others decode, a client cancel, a stop token id, and a KV budget small enough to force preemption.
Every request must end with exactly one terminal event.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import importlib.util
import os
import random
import time

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

from bench.loop_rig import LoopRig  # noqa: E402
from blink_appliance.engine.loop.state import COUNTER_INDEX, DeviceState, LoopGeometry, SlotState  # noqa: E402
from blink_appliance.engine.loop.step import LoopStep  # noqa: E402
from blink_appliance.engine.reference.engine import EngineConfig, LLMEngine  # noqa: E402
from blink_appliance.model.kv_cache import ForwardBatch, PagedKVCache  # noqa: E402
from blink_appliance.model.loaders import build_model, load_checkpoint  # noqa: E402
from blink_appliance.model.step_inputs import StepInputs  # noqa: E402
from blink_appliance.wire.client import EngineClient  # noqa: E402
from blink_appliance.wire.request import FinishReason, Request, SamplingParams  # noqa: E402
from blink_appliance.wire.ring_layout import RingGeometry  # noqa: E402

HAVE_GPU_STACK = (
    importlib.util.find_spec("cupy") is not None and importlib.util.find_spec("cuda.bindings") is not None
)
cpu_only = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU harness (the interpreted forward)")

RING = RingGeometry(
    request_slots=8,
    arena_tokens=1024,
    max_prompt_tokens=64,
    max_inflight=12,
    max_output_tokens=32,
    max_stop_ids=4,
)
# The engine numbers both sides share. 14 blocks of 4 tokens: the workload below needs more at its
# peak, so the scheduler must preempt (and recompute) to finish it.
ENGINE = dict(block_size=4, num_kv_blocks=14, max_num_seqs=4, max_num_batched_tokens=16, max_model_len=48)
GEOMETRY = LoopGeometry(
    num_slots=6, max_num_seqs=ENGINE["max_num_seqs"], max_num_batched_tokens=16, buckets=(4, 16),
    block_size=ENGINE["block_size"], num_kv_blocks=ENGINE["num_kv_blocks"], max_model_len=ENGINE["max_model_len"],
    max_stop_ids=RING.max_stop_ids, vocab_size=512, eos_token_ids=(2,),
)  # fmt: skip


@functools.cache
def checkpoint():
    return load_checkpoint("dummy:tiny", seed=0)


def prompt(rid: int, length: int) -> list[int]:
    return [(rid * 37 + i * 11) % 500 + 3 for i in range(length)]


def greedy(n: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, **kw)


SAMPLED = SamplingParams(
    temperature=0.9, top_k=40, top_p=0.9, min_p=0.02, seed=1234, max_tokens=10, ignore_eos=True
)

# (name, arrival step, prompt, params); arrivals after step 0 come while others decode.
WORKLOAD = [
    ("short", 0, prompt(1, 5), greedy(12)),
    ("chunked", 0, prompt(2, 21), greedy(8)),  # more than one step's budget: prefilled in chunks
    ("sampled", 0, prompt(3, 7), SAMPLED),
    ("cancel", 1, prompt(4, 6), greedy(30)),  # cancelled by the client after a few tokens
    ("late", 3, prompt(5, 9), greedy(10)),
    ("sampled-again", 5, prompt(3, 7), SAMPLED),  # the same seeded request later, in another batch
    ("one-token", 6, prompt(6, 3), greedy(1)),
]
CANCEL_AFTER = 3  # tokens the cancelled request receives before the client cancels


def reference_streams() -> dict[str, list[int]]:
    """Each request run to completion by the CPU reference engine (same weights, same numbers)."""
    model = build_model(checkpoint(), torch.float32, "cpu")
    out = {}
    for name, _, tokens, params in WORKLOAD:
        engine = LLMEngine(model, EngineConfig(seed=0, **ENGINE))
        out[name] = engine.generate([Request(0, tokens, params)])[0]
    return out


def stop_token_case(reference: dict[str, list[int]]) -> tuple[str, int, list[int], SamplingParams]:
    """A request that must stop on a stop id: the 4th token of 'late''s greedy stream."""
    _, arrival, tokens, params = next(w for w in WORKLOAD if w[0] == "late")
    stop = reference["late"][3]
    return ("stop-id", arrival + 1, tokens, greedy(10, stop_token_ids=(stop,)))


def region_tensor(transport) -> torch.Tensor:
    return torch.frombuffer(transport.buffer, dtype=torch.uint8)


class ReferenceStepForward:
    """GpuForward's step interface computed by the reference model: reads the first T rows of the
    static StepInputs (padding and unused sequences as docs/kv_layout.md has them) and writes the
    logits of the min(T, max_seqs) sample rows."""

    def __init__(self, geometry: LoopGeometry) -> None:
        ckpt = checkpoint()
        c = ckpt.config
        self.model = build_model(ckpt, torch.float32, "cpu")
        self.kv = PagedKVCache.allocate(
            c.num_layers,
            geometry.num_kv_blocks,
            geometry.block_size,
            c.num_kv_heads,
            c.head_dim,
            torch.float32,
        )
        self.max_tokens, self.max_seqs = geometry.max_num_batched_tokens, geometry.max_num_seqs
        self.score_rows = geometry.prompt_score_chunk
        self.inputs = StepInputs.allocate(
            self.max_tokens, self.max_seqs, geometry.max_blocks_per_seq, "cpu", self.score_rows
        )
        self.logits = torch.zeros(self.max_seqs, c.vocab_size)
        self.score_logits = torch.zeros(self.score_rows, c.vocab_size)

    def step(self, num_tokens: int) -> torch.Tensor:
        """The sample rows' logits, and the scored prompt rows' (for score())."""
        inp, rows, scored = self.inputs, min(num_tokens, self.max_seqs), min(num_tokens, self.score_rows)
        batch = ForwardBatch(
            input_ids=inp.input_ids[:num_tokens], positions=inp.positions[:num_tokens],
            slot_mapping=inp.slot_mapping[:num_tokens], query_start=inp.query_start,
            context_lens=inp.context_lens, block_tables=inp.block_tables,
            sample_rows=torch.cat([inp.sample_rows[:rows], inp.score_rows[:scored]]),
        )  # fmt: skip
        logits = self.model(batch, self.kv)
        self.logits[:rows] = logits[:rows]
        self.score_logits[:scored] = logits[rows:]
        return self.logits[:rows]

    def score(self) -> torch.Tensor:
        return self.score_logits


async def serve(rig: LoopRig, client: EngineClient, workload) -> tuple[dict, int]:
    """Drive the loop (one host_step per beat, or the device loop running by itself), submitting on
    schedule; the streams by name. The clock is the beat count when host-driven; in the device loop
    it is the number of tokens the first request has received (about one per iteration)."""
    streams: dict[str, list] = {}
    tasks: dict[str, asyncio.Task] = {}
    ids: dict[str, int] = {}

    async def collect(rid: int, into: list) -> None:
        async for event in client.stream(rid):
            into.append(event)

    steps = 0
    cancelled = False
    pending = list(workload)
    deadline = time.monotonic() + 120
    while True:
        rig.heartbeat()  # the client submits only to a live engine
        clock = steps if rig.loop is None else len(streams.get(workload[0][0], []))
        for w in [w for w in pending if w[1] <= clock]:
            name, _, tokens, params = w
            ids[name] = client.submit(tokens, params)
            streams[name] = []
            tasks[name] = asyncio.create_task(collect(ids[name], streams[name]))
            pending.remove(w)
        rig.beat()
        steps += 1
        for _ in range(3):
            await asyncio.sleep(0)  # the client's pump reads the channels
        if rig.loop is not None:
            await asyncio.sleep(0.0002)
        if not cancelled and len(streams.get("cancel", [])) >= CANCEL_AFTER:
            client.cancel(ids["cancel"])
            cancelled = True
        if not pending and all(t.done() for t in tasks.values()):
            return streams, steps
        assert time.monotonic() < deadline, f"workload not done after {steps} steps"


async def run_workload(
    workload, *, target: str = "cpu", geometry: LoopGeometry = GEOMETRY, ring: RingGeometry = RING
) -> tuple[dict, LoopStep, int]:
    """`target`: "cpu" (ReferenceStepForward), "cpu-real" (the interpreted GpuForward), "cuda-host"
    or "cuda-loop" (the real forward on the GPU, host-driven or in the device loop)."""
    if target == "cpu":
        rig = LoopRig.build(ring, geometry, forward=ReferenceStepForward(geometry))
    else:
        device = "cpu" if target == "cpu-real" else "cuda"
        rig = LoopRig.build(
            ring, geometry, checkpoint=checkpoint(), device=device, in_loop=target == "cuda-loop"
        )
    try:
        rig.start()
        client = rig.client()
        await client.start()
        try:
            streams, steps = await serve(rig, client, workload)
        finally:
            await client.close()
        rig.stop()
        assert rig.step.state.problems() == []
        return streams, rig.step, steps
    finally:
        rig.close()


@functools.cache
def reference() -> dict[str, list[int]]:
    return reference_streams()


TARGETS = ["cuda-host", "cuda-loop"] if torch.cuda.is_available() else ["cpu"]


@pytest.mark.parametrize("target", TARGETS)
async def test_loop_streams_equal_the_reference_engine(target):
    if target.startswith("cuda") and not HAVE_GPU_STACK:
        pytest.skip("needs cupy and cuda-bindings (the GPU extra)")
    ref = reference()
    workload = [*WORKLOAD, stop_token_case(ref)]
    streams, loop, _ = await run_workload(workload, target=target)

    for name, events in streams.items():
        assert events, name
        finished = [e for e in events if e.finished]
        assert len(finished) == 1 and events[-1].finished, f"{name}: {events}"
        assert all(e.timestamp_ns > 0 for e in events), name
    tokens = {
        name: [e.token_id for e in events if e.token_id is not None] for name, events in streams.items()
    }
    for name in ("short", "chunked", "late", "one-token", "sampled", "sampled-again"):
        assert tokens[name] == ref[name], name
        assert streams[name][-1].finish_reason is FinishReason.LENGTH, name
    assert tokens["sampled"] == tokens["sampled-again"]  # the seed alone decides the stream
    assert tokens["sampled"] != ref["short"][: len(tokens["sampled"])]

    cancel = streams["cancel"]
    assert cancel[-1].finish_reason is FinishReason.ABORT and cancel[-1].token_id is None
    assert cancel[-1].error is None
    assert CANCEL_AFTER <= len(tokens["cancel"]) < 30
    assert tokens["cancel"] == ref["cancel"][: len(tokens["cancel"])]

    stop = streams["stop-id"]
    assert stop[-1].finish_reason is FinishReason.STOP and tokens["stop-id"] == ref["late"][:4]

    counters = loop.state.counters
    assert int(counters[COUNTER_INDEX["preemptions"]]) > 0, "the KV budget should have forced preemption"
    assert int(counters[COUNTER_INDEX["generated_tokens"]]) == sum(len(t) for t in tokens.values())
    assert int(counters[COUNTER_INDEX["requests_finished"]]) == len(workload)
    assert int(loop.state.num_active[0]) == 0
    assert int(loop.state.free_top[0]) == GEOMETRY.num_kv_blocks  # every block came back


SHARED = prompt(2, 21)  # 5 full blocks of 4
PREFIX_WORKLOAD = [
    ("first", 0, SHARED, greedy(6)),
    ("again", 4, SHARED, greedy(6)),  # after first's prefill: its 5 blocks cached (the last is fed again)
    ("longer", 5, SHARED + prompt(9, 6), greedy(5)),  # 5 blocks cached, the rest prefilled
    ("shorter", 6, SHARED[:10], greedy(4)),  # 2 blocks cached
    ("other", 6, prompt(8, 13), greedy(8)),  # nothing cached; blocks run short: preemption, eviction
]


@pytest.mark.parametrize("target", TARGETS)
async def test_loop_with_the_prefix_cache_streams_what_the_reference_streams_alone(target):
    """Prompts that share a prefix, on a loop that caches prefixes (the ring carries block hashes):
    every stream equals the reference engine's for that request alone, without the cache; the hits
    are counted; every block is free or cached at the end."""
    if target.startswith("cuda") and not HAVE_GPU_STACK:
        pytest.skip("needs cupy and cuda-bindings (the GPU extra)")
    model = build_model(checkpoint(), torch.float32, "cpu")
    want = {
        name: LLMEngine(model, EngineConfig(seed=0, **ENGINE)).generate([Request(0, tokens, params)])[0]
        for name, _, tokens, params in PREFIX_WORKLOAD
    }
    geometry = dataclasses.replace(GEOMETRY, prefix_cache=True)
    ring = dataclasses.replace(RING, prefix_block_size=GEOMETRY.block_size)
    streams, loop, _ = await run_workload(PREFIX_WORKLOAD, target=target, geometry=geometry, ring=ring)
    tokens = {name: [e.token_id for e in ev if e.token_id is not None] for name, ev in streams.items()}
    assert tokens == want
    counters = loop.state.counters
    assert int(counters[COUNTER_INDEX["prefix_cache_hits"]]) >= 4 * 5, "again found first's 5 blocks"
    assert int(loop.state.free_top[0]) + int(loop.state.lru_words[2]) == GEOMETRY.num_kv_blocks


def reference_events(model, tokens: list[int], params: SamplingParams) -> list:
    """The token events of one request run alone by the CPU reference engine (ENGINE's numbers)."""
    engine = LLMEngine(model, EngineConfig(seed=0, **ENGINE))
    engine.add_request(Request(0, tokens, params))
    events = []
    while engine.has_unfinished():
        events += [e for e in engine.step() if e.token_id is not None]
    return events


def _close(got, want) -> bool:
    """Two TokenLogprobs agree: the token, its logprob and the alternatives' within 1e-3, same ids."""
    if got is None or want is None:
        return got is want
    return (
        got.token_id == want.token_id
        and abs(got.logprob - want.logprob) < 1e-3
        and [t for t, _ in got.top] == [t for t, _ in want.top]
        and all(abs(a - b) < 1e-3 for (_, a), (_, b) in zip(got.top, want.top, strict=True))
    )


@pytest.mark.slow
@cpu_only
async def test_loop_with_the_real_gpu_forward_matches_the_reference():
    """LoopStep.build's GpuForward (interpreted Triton, ~20 s per step): prefill + one decode, the
    prompt scored too (the final norm's second gather, GpuForward.score)."""
    geometry = dataclasses.replace(GEOMETRY, buckets=(16,))  # one bucket: no split-KV programs
    tokens = prompt(9, 5)
    params = greedy(2, logprobs=2, prompt_logprobs=True)
    streams, loop, _ = await run_workload([("two", 0, tokens, params)], target="cpu-real", geometry=geometry)
    want = reference_events(build_model(checkpoint(), torch.float32, "cpu"), tokens, params)
    got = streams["two"]
    assert [e.token_id for e in got] == [e.token_id for e in want] and got[-1].finished
    assert all(_close(g.logprobs, w.logprobs) for g, w in zip(got, want, strict=True))
    assert len(got[0].prompt_logprobs) == len(tokens) - 1
    assert all(_close(g, w) for g, w in zip(got[0].prompt_logprobs, want[0].prompt_logprobs, strict=True))
    # The loop's own count of forwards, not the host's beats: on a loaded host the client may read
    # the last token a beat late, and that extra beat runs no forward.
    assert int(loop.state.counters[COUNTER_INDEX["steps"]]) == 2 and loop.graphs is None


# The geometry of bench/loop_cpu_time.py's batch-64 run (num_slots 128, 64 sequences, a 512-token
# budget, 16-token blocks) with a small KV pool: 64 requests at once fill the batch over several
# steps of admission, decode together and release together.
WIDE_RING = RingGeometry(
    request_slots=64,
    arena_tokens=4096,
    max_prompt_tokens=64,
    max_inflight=128,
    max_output_tokens=32,
    max_stop_ids=4,
)
WIDE = LoopGeometry(
    num_slots=128, max_num_seqs=64, max_num_batched_tokens=512, buckets=(8, 32, 128, 512), block_size=16,
    num_kv_blocks=600, max_model_len=1024, max_stop_ids=4, vocab_size=512, eos_token_ids=(2,),
)  # fmt: skip


@pytest.mark.parametrize("arrivals", ["at-once", "trickle"])
@pytest.mark.parametrize("target", TARGETS)
async def test_sixty_four_requests_keep_the_bookkeeping_consistent_every_step(target, arrivals):
    """Host-driven, the state is checked after every step; in the device loop, after shutdown. On
    the GPU the program's lanes span several warps here (128 slots), unlike the small geometry."""
    if target.startswith("cuda") and not HAVE_GPU_STACK:
        pytest.skip("needs cupy and cuda-bindings (the GPU extra)")
    if target == "cpu":
        rig = LoopRig.build(WIDE_RING, WIDE, forward=ReferenceStepForward(WIDE))
    else:
        rig = LoopRig.build(
            WIDE_RING, WIDE, checkpoint=checkpoint(), device="cuda", in_loop=target == "cuda-loop"
        )
    rng = random.Random(3)
    state, steps, peak, submitted = rig.step.state, 0, 0, 0
    streams: dict[int, list] = {}
    try:
        rig.start()
        client = rig.client()
        await client.start()

        async def collect(rid: int) -> None:
            async for event in client.stream(rid):
                streams[rid].append(event)

        tasks = []
        while submitted < 64 or not all(t.done() for t in tasks):
            rig.heartbeat()  # a client started after the last beat waits for a fresh one
            for _ in range(min(64 - submitted, 64 if arrivals == "at-once" else rng.choice([0, 1, 1, 2, 3]))):
                rid = client.submit(prompt(submitted, 16), greedy(24))
                streams[rid] = []
                tasks.append(asyncio.create_task(collect(rid)))
                submitted += 1
            rig.beat()
            steps += 1
            if rig.loop is None:
                assert state.problems() == [], f"after step {steps}"
                peak = max(peak, WIDE.num_kv_blocks - int(state.free_top[0]))
            for _ in range(3):
                await asyncio.sleep(0)
            if rig.loop is not None:
                await asyncio.sleep(0.0005)
            assert steps < (200 if rig.loop is None else 20000)
        await client.close()
        rig.stop()
    finally:
        rig.close()
    assert state.problems() == []
    if arrivals == "at-once" and rig.loop is None:
        assert peak == 64 * 3  # 16 prompt + 24 generated tokens: 3 blocks each, all held at once
    assert [len(s) for s in streams.values()] == [24] * 64
    assert all(sum(e.finished for e in s) == 1 for s in streams.values())
    # Every token was read after the engine wrote it: stamped, in time order (an output slot read
    # before its write shows as token 0 stamped 0).
    for s in streams.values():
        stamps = [e.timestamp_ns for e in s if e.token_id is not None]
        assert all(stamps) and stamps == sorted(stamps), stamps
    # The client holds back a token whose count arrived first (and counts it); the loop must not
    # make it wait at all (on the H100 it once did: kernels/commit.py's fences).
    assert client.payload_waits == 0
    counters = state.counters.tolist()
    assert counters[COUNTER_INDEX["generated_tokens"]] == 64 * 24
    assert counters[COUNTER_INDEX["requests_admitted"]] == counters[COUNTER_INDEX["requests_finished"]] == 64
    # Every iteration that ran a forward was timed into the histogram (schedule start to commit).
    assert int(state.step_time_hist.sum()) == counters[COUNTER_INDEX["steps"]] > 0
    assert counters[COUNTER_INDEX["last_step_ns"]] > 0
    assert int(state.free_top[0]) == WIDE.num_kv_blocks and int(state.num_active[0]) == 0


def test_state_problems_name_a_double_release_a_leak_and_shared_run_orders():
    state = DeviceState.allocate(WIDE, "cpu")
    assert state.problems() == []
    state.block_table[5, :2] = torch.tensor([7, 8], dtype=torch.int32)  # taken off the stack below
    state.num_blocks[5] = 2
    state.block_ref[[7, 8]] = 1
    state.slot_state[5] = SlotState.RUNNING
    state.free_top[0] = WIDE.num_kv_blocks - 2
    state.free_blocks[: WIDE.num_kv_blocks - 2] = torch.tensor(
        [b for b in range(WIDE.num_kv_blocks) if b not in (7, 8)], dtype=torch.int32
    )
    assert state.problems() == []
    state.free_blocks[WIDE.num_kv_blocks - 2] = 7  # released again: pushed while still in the table
    state.free_top[0] += 1
    assert "twice e.g. [7]" in state.problems()[0]
    state.free_top[0] = WIDE.num_kv_blocks + 1
    assert state.problems() == [f"free_top {WIDE.num_kv_blocks + 1} outside [0, {WIDE.num_kv_blocks}]"]
    state.free_top[0] = WIDE.num_kv_blocks - 3  # one block neither free nor held
    assert "1 missing" in state.problems()[0]
    state.free_top[0] = WIDE.num_kv_blocks - 2
    state.slot_state[5] = SlotState.WAITING
    assert state.problems() == ["slot 5 is WAITING but holds 2 blocks"]
    state.slot_state[5] = state.slot_state[9] = SlotState.RUNNING
    state.run_order[5] = state.run_order[9] = 3  # the schedule ranks RUNNING slots by run order
    assert state.problems() == ["RUNNING slots share run orders, e.g. [3]"]
    state.run_order[9] = 4
    state.block_ref[8] = 2  # a holder the tables do not show
    assert state.problems() == ["holder counts differ from the tables, e.g. blocks [8]"]
    state.block_ref[8] = 1
    state.block_cached[8] = 1  # cached, but not in the table
    assert state.problems() == [
        "cache table names [8] wrongly",
        "cached block 8 is not at its hash's table entry",
    ]


def test_build_takes_the_gemm_plan_the_profile_asks_for():
    """LoopStep.build(deterministic=True) (profile engine.deterministic) gives the forward the plan
    without atomics; the default adds O and down into the residual stream."""
    from blink_appliance.model.gpu_weights import GpuWeights
    from blink_appliance.model.launch_plans import decode_gemms, deterministic_gemms
    from blink_appliance.wire.ring_layout import RingLayout, region_size

    ckpt = checkpoint()
    weights = GpuWeights.from_hf(ckpt.config, ckpt.weights, torch.float32, "cpu")
    ring = torch.zeros(region_size(RING), dtype=torch.uint8)
    for deterministic, plan in ((False, decode_gemms), (True, deterministic_gemms)):
        step = LoopStep.build(
            ckpt.config, weights, ring, RingLayout.of(RING), GEOMETRY, "cpu", torch.float32,
            deterministic=deterministic,
        )  # fmt: skip
        assert step.forward_runner.gemm_plan is plan
        assert step.forward_runner._gemms(8).accumulates != deterministic
