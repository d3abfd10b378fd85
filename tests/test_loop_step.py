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
import os
import time

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

from blink_appliance.engine.device_state import COUNTER_INDEX, LoopGeometry  # noqa: E402
from blink_appliance.engine.llm_engine import EngineConfig, LLMEngine  # noqa: E402
from blink_appliance.engine.loop_step import LoopStep  # noqa: E402
from blink_appliance.engine.request import FinishReason, Request, SamplingParams  # noqa: E402
from blink_appliance.model.gpu_forward import GpuWeights, StepInputs  # noqa: E402
from blink_appliance.model.kv_cache import ForwardBatch, PagedKVCache  # noqa: E402
from blink_appliance.model.loaders import build_model, load_checkpoint  # noqa: E402
from blink_appliance.transport.engine_client import EngineClient  # noqa: E402
from blink_appliance.transport.region import RingRegion  # noqa: E402
from blink_appliance.transport.ring_layout import EngineState, RingGeometry, RingLayout  # noqa: E402
from tests.test_ring_support import shm_region  # noqa: E402

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU harness; B1/B2 run the GPU version")

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
    return torch.frombuffer(transport._buf, dtype=torch.uint8)  # noqa: SLF001


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
        self.inputs = StepInputs.allocate(self.max_tokens, self.max_seqs, geometry.max_blocks_per_seq, "cpu")
        self.logits = torch.zeros(self.max_seqs, c.vocab_size)

    def step(self, num_tokens: int) -> torch.Tensor:
        inp, rows = self.inputs, min(num_tokens, self.max_seqs)
        batch = ForwardBatch(
            input_ids=inp.input_ids[:num_tokens], positions=inp.positions[:num_tokens],
            slot_mapping=inp.slot_mapping[:num_tokens], query_start=inp.query_start,
            context_lens=inp.context_lens, block_tables=inp.block_tables, sample_rows=inp.sample_rows[:rows],
        )  # fmt: skip
        self.logits[:rows] = self.model(batch, self.kv)
        return self.logits[:rows]


async def serve(loop: LoopStep, region: RingRegion, client: EngineClient, workload) -> tuple[dict, int]:
    """Drive the loop one host_step at a time, submitting on schedule; the streams by name."""
    streams: dict[str, list] = {}
    tasks: dict[str, asyncio.Task] = {}
    ids: dict[str, int] = {}

    async def collect(rid: int, into: list) -> None:
        async for event in client.stream(rid):
            into.append(event)

    steps = 0
    cancelled = False
    deadline = time.monotonic() + 120
    while True:
        region.store("engine_heartbeat_ns", time.monotonic_ns())  # the client submits only to a live engine
        for name, arrival, tokens, params in workload:
            if arrival == steps:
                ids[name] = client.submit(tokens, params)
                streams[name] = []
                tasks[name] = asyncio.create_task(collect(ids[name], streams[name]))
        loop.host_step()
        steps += 1
        for _ in range(3):
            await asyncio.sleep(0)  # the client's pump reads the channels
        if not cancelled and len(streams.get("cancel", [])) >= CANCEL_AFTER:
            client.cancel(ids["cancel"])
            cancelled = True
        if steps > max(w[1] for w in workload) and all(t.done() for t in tasks.values()):
            return streams, steps
        assert time.monotonic() < deadline, f"workload not done after {steps} steps"


async def run_workload(
    workload, *, real_forward: bool = False, geometry: LoopGeometry = GEOMETRY
) -> tuple[dict, LoopStep, int]:
    ckpt = checkpoint()
    cfg = ckpt.config
    with shm_region(RING) as transport:
        region = RingRegion.attach(transport, RING)
        ring, layout = region_tensor(transport), RingLayout.of(RING)
        if real_forward:
            weights = GpuWeights.from_hf(cfg, ckpt.weights, torch.float32, "cpu")
            loop = LoopStep.build(cfg, weights, ring, layout, geometry, "cpu", torch.float32, engine_seed=7)
        else:
            loop = LoopStep.assemble(geometry, ReferenceStepForward(geometry), ring, layout, engine_seed=7)
        region.store("engine_heartbeat_ns", time.monotonic_ns())
        region.store("engine_state", EngineState.RUNNING)
        client = EngineClient.attach(transport, RING, dead_after_s=600.0)
        await client.start()
        try:
            streams, steps = await serve(loop, region, client, workload)
        finally:
            await client.close()
        return streams, loop, steps


@functools.cache
def reference() -> dict[str, list[int]]:
    return reference_streams()


async def test_loop_streams_equal_the_reference_engine():
    ref = reference()
    workload = [*WORKLOAD, stop_token_case(ref)]
    streams, loop, _ = await run_workload(workload)

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


@pytest.mark.slow
async def test_loop_with_the_real_gpu_forward_matches_the_reference():
    """LoopStep.build's GpuForward (interpreted Triton, ~20 s per step): prefill + one decode."""
    geometry = dataclasses.replace(GEOMETRY, buckets=(16,))  # one bucket: no split-KV programs
    tokens = prompt(9, 5)
    streams, loop, steps = await run_workload(
        [("two", 0, tokens, greedy(2))], real_forward=True, geometry=geometry
    )
    model = build_model(checkpoint(), torch.float32, "cpu")
    want = LLMEngine(model, EngineConfig(seed=0, **ENGINE)).generate([Request(0, tokens, greedy(2))])[0]
    assert [e.token_id for e in streams["two"]] == want and streams["two"][-1].finished
    assert steps == 2 and loop.graphs is None
