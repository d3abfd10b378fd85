"""The device loop's schedule step (DeviceScheduler, kernels/schedule.py) against the CPU reference.

Two regions receive the same front-end writes (records, prompts, cancels, shutdown) with the bytes
EngineClient.submit writes. One is served by the reference: EngineServer's own admission and cancel
code over an LLMEngine (tiny random model), whose Scheduler/BlockAllocator decide each step. The other
is read by DeviceScheduler.launch() (Triton; on the CPU under TRITON_INTERPRET=1). After every
iteration the test compares the step both made, chunk by chunk and block by block: scheduled
requests in order, chunk sizes, input ids, positions, slot mapping, block tables, sample rows and
their sampling parameters, the bucket, preemptions, running/waiting order, the free list, the ring's
consumer words, and the finish codes of cancelled / rejected / shut-down requests. The device side is
then committed by the test with the reference's sampled tokens (what commit will do on the GPU).
"""

from __future__ import annotations

import inspect
import mmap
import os
import re
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

from blink_appliance.kernels import schedule as schedule_module  # noqa: E402

from blink_appliance.engine.device_scheduler import DeviceScheduler  # noqa: E402
from blink_appliance.engine.device_state import (  # noqa: E402
    COUNTER_INDEX,
    DeviceState,
    LoopGeometry,
    SlotState,
)
from blink_appliance.engine.llm_engine import EngineConfig, LLMEngine  # noqa: E402
from blink_appliance.engine.request import FinishReason, SamplingParams, TokenEvent  # noqa: E402
from blink_appliance.engine.rng import row_keys  # noqa: E402
from blink_appliance.engine.scheduler import SchedulerOutput, build_forward_batch  # noqa: E402
from blink_appliance.model.gpu_forward import StepInputs  # noqa: E402
from blink_appliance.model.loaders import build_model, load_checkpoint  # noqa: E402
from blink_appliance.transport.engine_server import EngineServer  # noqa: E402
from blink_appliance.transport.region import RingRegion  # noqa: E402
from blink_appliance.transport.ring_layout import (  # noqa: E402
    FINISH_CODES,
    ErrorCode,
    RingGeometry,
    RingLayout,
)
from blink_appliance.transport.transport import Transport  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ENGINE_SEED = 20261122
RING = RingGeometry(
    request_slots=8,
    arena_tokens=512,
    max_prompt_tokens=48,
    max_inflight=6,
    max_output_tokens=12,
    max_stop_ids=4,
)
# 10 blocks of 4 tokens: a few requests already exhaust the KV cache, so preemption is routine.
LOOP = LoopGeometry(
    num_slots=6, max_num_seqs=3, max_num_batched_tokens=16, buckets=(4, 8, 16), block_size=4,
    num_kv_blocks=10, max_model_len=32, max_stop_ids=4, vocab_size=512, eos_token_ids=(2,),
)  # fmt: skip


class MemoryTransport(Transport):
    """A region in anonymous memory (one process; page aligned, so it can be registered with CUDA):
    the same offsets and ordering as shared memory."""

    def __init__(self, size: int) -> None:
        self.buffer = mmap.mmap(-1, size)
        self._u64 = np.frombuffer(self.buffer, dtype="<u8")

    @property
    def size(self) -> int:
        return len(self.buffer)

    def read(self, offset: int, nbytes: int) -> bytes:
        self._check(offset, nbytes)
        return bytes(self.buffer[offset : offset + nbytes])

    def write(self, offset: int, data: bytes | bytearray | memoryview) -> None:
        view = memoryview(data).cast("B")
        self._check(offset, view.nbytes)
        self.buffer[offset : offset + view.nbytes] = view

    def load_u64(self, offset: int) -> int:
        return int(self._u64[offset >> 3])

    def store_u64(self, offset: int, value: int) -> None:
        self._u64[offset >> 3] = value

    def close(self) -> None:
        pass


@dataclass
class Submitted:
    request_id: int
    channel: int
    generation: int


class TwinFrontEnd:
    """Writes every request into several regions exactly as EngineClient.submit does (claim the
    lowest free channel, prompt into the arena, record payload, seq, req_head); `record` overrides
    fields after they are filled, to make broken records."""

    def __init__(self, regions: list[RingRegion]) -> None:
        self.regions = regions
        self.head = 0
        self.arena_head = 0
        self.next_id = 1

    def free_channel(self) -> int:
        for chan in range(RING.max_inflight):
            free = [r.load_ctl(chan, "generation") == r.load_progress(chan, "done") for r in self.regions]
            assert len(set(free)) == 1, "the two engines disagree on a channel's ownership"
            if free[0]:
                return chan
        raise AssertionError("no free channel")

    def submit(
        self,
        prompt: list[int],
        params: SamplingParams | None = None,
        priority: int = 0,
        *,
        record: dict[str, object] | None = None,
        request_id: int | None = None,
    ) -> Submitted:
        params = params or SamplingParams(temperature=0.0, max_tokens=4)
        g = RING
        n = len(prompt)
        position = self.arena_head
        if position % g.arena_tokens + n > g.arena_tokens:
            position += g.arena_tokens - position % g.arena_tokens
        end = position + n
        chan = self.free_channel()
        rid = self.next_id if request_id is None else request_id
        self.next_id += 1
        for r in self.regions:
            assert end - r.load("arena_tail") <= g.arena_tokens, "test arena too small"
            generation = r.load_ctl(chan, "generation") + 1
            r.store_progress(chan, "count", 0)
            r.clear_status(chan)
            r.store_ctl(chan, "request_id", rid)
            r.store_ctl(chan, "generation", generation)
            r.write_prompt(position, np.asarray(prompt, dtype="<i4"))
            r.store("arena_head", end)
            rec = r.new_record()
            f = rec[0]
            f["request_id"], f["generation"], f["slot"], f["priority"] = rid, generation, chan, priority
            f["prompt_offset"], f["arena_end"], f["prompt_len"] = position, end, n
            f["max_tokens"], f["temperature"], f["top_p"] = (
                params.max_tokens,
                params.temperature,
                params.top_p,
            )
            f["min_p"], f["top_k"], f["ignore_eos"] = params.min_p, params.top_k, int(params.ignore_eos)
            f["has_seed"], f["seed"] = int(params.seed is not None), params.seed or 0
            f["n_stop"] = len(params.stop_token_ids)
            f["stop_ids"][: len(params.stop_token_ids)] = params.stop_token_ids
            for name, value in (record or {}).items():
                f[name] = value
            r.publish_record(self.head, rec)
            r.store("next_request_id", self.next_id)
            r.doorbell("req_head", self.head + 1)
        self.head += 1
        self.arena_head = end
        return Submitted(rid, chan, generation)

    def cancel(self, sub: Submitted) -> None:
        for r in self.regions:
            r.store_ctl(sub.channel, "cancel", sub.generation)

    def shutdown(self) -> None:
        for r in self.regions:
            r.store("shutdown", 1)


@dataclass(frozen=True)
class Chunk:
    request_id: int
    start: int
    num_tokens: int


@dataclass
class RefStep:
    chunks: list[Chunk]
    batch: object  # ForwardBatch or None
    sampling: list[tuple[int, SamplingParams, int, int]]  # request id, params, seed, output index


@dataclass
class Stats:
    iterations: int = 0
    steps: int = 0
    tokens: int = 0
    preemptions: int = 0
    admitted_while_running: int = 0
    finishes: list[tuple[int, int, int]] = field(default_factory=list)  # (channel, finish code, error code)

    def last_finish(self, channel: int) -> tuple[int, int]:
        return next((r, c) for ch, r, c in reversed(self.finishes) if ch == channel)


_MODEL = None
_MAPPED: list = []  # mapped ring buffers of this test's twins


@pytest.fixture(autouse=True)
def _unmap_rings():
    """Unregister every ring a test mapped: a buffer freed while still registered leaves its address
    range registered, and the next test's buffer at that address would fail to register."""
    yield
    if _MAPPED:
        torch.cuda.synchronize()
    while _MAPPED:
        _MAPPED.pop().close()


def tiny_model():
    global _MODEL
    if _MODEL is None:
        _MODEL = build_model(load_checkpoint("dummy:tiny", seed=5), torch.float32, "cpu")
    return _MODEL


class Twin:
    """The reference engine and the device scheduler, fed the same ring traffic, stepped together."""

    def __init__(
        self, loop: LoopGeometry = LOOP, *, check_slot_is_channel: bool = True, cuda_graph: bool = False
    ) -> None:
        layout = RingLayout.of(RING)
        self.loop = loop
        self.ref_transport, self.dev_transport = MemoryTransport(layout.size), MemoryTransport(layout.size)
        self.ref_region = RingRegion.create(self.ref_transport, RING)
        self.dev_region = RingRegion.create(self.dev_transport, RING)
        self.front = TwinFrontEnd([self.ref_region, self.dev_region])
        config = EngineConfig(
            block_size=loop.block_size, num_kv_blocks=loop.num_kv_blocks, max_num_seqs=loop.max_num_seqs,
            max_num_batched_tokens=loop.max_num_batched_tokens, max_model_len=loop.max_model_len, seed=7,
        )  # fmt: skip
        self.engine = LLMEngine(tiny_model(), config)
        self.server = EngineServer(self.engine, self.ref_transport, RING)
        self._captured: RefStep | None = None
        run = self.engine.runner.run

        def capture_then_run(out: SchedulerOutput) -> list[int]:
            self._captured = self._snapshot(out)
            return run(out)

        self.engine.runner.run = capture_then_run
        self.state = DeviceState.allocate(loop, DEVICE)
        self.inputs = StepInputs.allocate(
            loop.max_num_batched_tokens, loop.max_num_seqs, loop.max_blocks_per_seq, DEVICE
        )
        if DEVICE == "cuda":  # the ring as the loop sees it: host memory mapped into the GPU
            from blink_appliance.transport.mapped_region import MappedRegion

            self.mapped = MappedRegion(self.dev_transport.buffer, DEVICE)
            _MAPPED.append(self.mapped)
            ring = self.mapped.tensor(0, torch.uint8, layout.size)
        else:
            ring = torch.frombuffer(self.dev_transport.buffer, dtype=torch.uint8)
        self.scheduler = DeviceScheduler(loop, self.state, ring, layout, self.inputs, ENGINE_SEED)
        self.graph = None
        if cuda_graph:  # launch() recorded once, replayed every iteration
            self.scheduler.compile()
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):
                self.scheduler.launch()
        self.check_slot_is_channel = check_slot_is_channel
        self.stats = Stats()

    # -- the reference side -------------------------------------------------------------------------
    def _snapshot(self, out: SchedulerOutput) -> RefStep:
        chunks = [Chunk(c.seq.request_id, c.start, c.num_tokens) for c in out.chunks]
        batch = build_forward_batch(out.chunks, self.loop.block_size, "cpu")
        sampling = [
            (c.seq.request_id, c.seq.params, c.seq.seed, c.seq.num_output_tokens) for c in out.sampling_chunks
        ]
        return RefStep(chunks, batch, sampling)

    def _reference_iteration(self) -> tuple[RefStep, list[TokenEvent]]:
        """EngineServer.run's loop body (without the sleep and telemetry)."""
        self._captured = None
        events: list[TokenEvent] = []
        if self.ref_region.load("shutdown"):
            self.server._terminate_all(FinishReason.ABORT, ErrorCode.SHUTDOWN, "engine shut down")
        else:
            self.server._admit()
            if self.server._live:
                self.server._apply_cancels()
            if self.engine.has_unfinished():
                events = self.engine.step()
                self.server._publish(events)
        return self._captured or RefStep([], None, []), events

    # -- one iteration ------------------------------------------------------------------------------
    def step(self) -> RefStep:
        done_before = self.ref_region.progress_table()["done"].copy()
        running_before = len(self.engine.scheduler.running)
        preemptions_before = self.engine.scheduler.num_preemptions
        self.launch()
        ref, events = self._reference_iteration()
        self._compare_step(ref)
        finished_ref = {}
        for c in np.nonzero(self.ref_region.progress_table()["done"] != done_before)[0]:
            status = self.ref_region.read_status(int(c))
            finished_ref[int(c)] = (int(status["finish_reason"]), int(status["error_code"]))
        finished_dev = self._device_commit(events)
        assert finished_dev == finished_ref, "requests finished differently (channel -> finish, error code)"
        self._compare_state()
        self.stats.finishes += [(ch, r, c) for ch, (r, c) in sorted(finished_dev.items())]
        self.stats.iterations += 1
        self.stats.steps += bool(ref.chunks)
        self.stats.tokens += sum(c.num_tokens for c in ref.chunks)
        self.stats.preemptions += self.engine.scheduler.num_preemptions - preemptions_before
        if running_before and any(c.start == 0 for c in ref.chunks[running_before:]):
            self.stats.admitted_while_running += 1
        return ref

    def launch(self) -> None:
        if self.graph is not None:
            self.graph.replay()
        else:
            self.scheduler.launch()
        if DEVICE == "cuda":
            torch.cuda.synchronize()  # the test reads the mapped ring from the host next

    def run_until_idle(self, max_iterations: int = 200) -> None:
        for _ in range(max_iterations):
            queued = self.ref_region.load("req_head") - self.ref_region.load("req_tail")
            if not self.engine.has_unfinished() and not queued:
                return
            self.step()
        raise AssertionError("workload did not finish")

    # -- comparisons --------------------------------------------------------------------------------
    def _compare_step(self, ref: RefStep) -> None:
        s, inp, loop = self.state, self.inputs, self.loop
        slots = s.step_slot.tolist()
        nseq = sum(1 for x in slots if x >= 0)
        assert all(x >= 0 for x in slots[:nseq]) and all(x == -1 for x in slots[nseq:])
        rid = s.request_id.tolist()
        ctx, chunk = inp.context_lens.tolist(), s.step_chunk.tolist()
        device_chunks = [Chunk(rid[slots[b]], ctx[b] - chunk[b], chunk[b]) for b in range(nseq)]
        assert device_chunks == ref.chunks, "different chunks scheduled (request, start, tokens)"
        n = int(s.step_num_tokens)
        assert n == sum(c.num_tokens for c in ref.chunks)
        if n == 0:
            assert int(s.bucket_index) == len(loop.buckets)
            assert (s.sample_slot == -1).all() and int(s.sampler_index) == 0
            return
        bucket_index = next(i for i, b in enumerate(loop.buckets) if b >= n)
        assert int(s.bucket_index) == bucket_index
        bucket = loop.buckets[bucket_index]
        fb = ref.batch
        assert torch.equal(inp.input_ids[:n].cpu(), fb.input_ids)
        assert torch.equal(inp.positions[:n].cpu(), fb.positions)
        assert torch.equal(inp.slot_mapping[:n].cpu(), fb.slot_mapping)
        assert (inp.slot_mapping[n:bucket] == -1).all()
        assert (inp.input_ids[n:bucket] == 0).all() and (inp.positions[n:bucket] == 0).all()
        assert torch.equal(inp.query_start[: nseq + 1].cpu(), fb.query_start)
        assert (inp.query_start[nseq + 1 :] == n).all()
        assert torch.equal(inp.context_lens[:nseq].cpu(), fb.context_lens)
        assert (inp.context_lens[nseq:] == 0).all()
        width = fb.block_tables.shape[1]
        assert torch.equal(inp.block_tables[:nseq, :width].cpu(), fb.block_tables)
        assert (inp.block_tables[:nseq, width:] == -1).all() and (inp.block_tables[nseq:] == -1).all()
        r = len(ref.sampling)
        assert torch.equal(inp.sample_rows[:r].cpu(), fb.sample_rows) and (inp.sample_rows[r:] == -1).all()
        sample_slots = s.sample_slot.tolist()
        assert [rid[x] for x in sample_slots[:r]] == [x[0] for x in ref.sampling]
        assert all(x == -1 for x in sample_slots[r:])
        for row, (request_id, params, seed, output_index) in enumerate(ref.sampling):
            assert float(s.row_temperature[row]) == np.float32(params.temperature)
            assert float(s.row_top_p[row]) == np.float32(params.top_p)
            assert float(s.row_min_p[row]) == np.float32(params.min_p)
            assert int(s.row_top_k[row]) == params.top_k
            want_seed = seed if params.seed is not None else derived_seed(request_id)
            assert int(s.row_seed[row]) == want_seed
            assert int(s.row_output_index[row]) == output_index
        assert int(s.sampler_index) == int(any(p.temperature > 0 for _, p, _, _ in ref.sampling))

    def _compare_state(self) -> None:
        s, sched = self.state, self.engine.scheduler
        rid, state = s.request_id.tolist(), s.slot_state.tolist()
        slots = {
            rid[i]: i
            for i in range(self.loop.num_slots)
            if state[i] in (SlotState.WAITING, SlotState.RUNNING)
        }
        run_order = s.run_order.tolist()
        running = sorted(
            (i for i in slots.values() if state[i] == SlotState.RUNNING), key=lambda i: run_order[i]
        )
        assert [rid[i] for i in running] == [q.request_id for q in sched.running], "running order"
        prio, arrival = s.priority.tolist(), s.arrival.tolist()
        waiting = sorted(
            (i for i in slots.values() if state[i] == SlotState.WAITING), key=lambda i: (prio[i], arrival[i])
        )
        assert [rid[i] for i in waiting] == [q.request_id for q in sched.waiting], "waiting order"
        for seq in sched.running + sched.waiting:
            i = slots[seq.request_id]
            assert int(s.num_computed[i]) == seq.num_computed_tokens
            assert int(s.num_tokens[i]) == seq.num_tokens and int(s.prompt_len[i]) == seq.num_prompt_tokens
            assert (
                s.token_ids[i, : min(seq.num_tokens, self.loop.max_model_len)].tolist()
                == seq.token_ids[: self.loop.max_model_len]
            )
            nb = int(s.num_blocks[i])
            assert s.block_table[i, :nb].tolist() == seq.block_table and (s.block_table[i, nb:] == -1).all()
            if self.check_slot_is_channel:
                assert int(s.chan[i]) == i, "test premise: slots and channels are both taken lowest-first"
        top = int(s.free_top)
        assert s.free_blocks[:top].tolist() == self.engine.allocator._free, "free list (LIFO order included)"
        counters = s.counters.tolist()
        assert counters[COUNTER_INDEX["preemptions"]] == sched.num_preemptions
        for name in ("requests_admitted", "requests_rejected", "requests_cancelled", "records_unaddressable"):
            assert counters[COUNTER_INDEX[name]] == self.server._counters[name], name
        for word in ("req_tail", "arena_tail"):
            assert self.dev_region.load(word) == self.ref_region.load(word), word
        assert int(s.num_active) == sum(1 for x in s.slot_state.tolist() if x != SlotState.FREE)

    # -- the device side's commit (what the GPU commit kernel does; tokens from the reference) ------
    def _device_commit(self, events: list[TokenEvent]) -> dict[int, tuple[int, int]]:
        s = self.state
        by_request = {e.request_id: e for e in events if e.token_id is not None}
        finished: dict[int, tuple[int, int]] = {}
        for i in range(self.loop.num_slots):
            if int(s.slot_state[i]) == SlotState.FINISHING:
                assert int(s.num_blocks[i]) == 0 and (s.block_table[i] == -1).all()
                finished[int(s.chan[i])] = (int(s.finish_reason[i]), int(s.error_code[i]))
                self._free(i)
        for row in range(self.loop.max_num_seqs):
            i = int(s.sample_slot[row])
            if i < 0:
                continue
            event = by_request[int(s.request_id[i])]
            n = int(s.num_tokens[i])
            if n < self.loop.max_model_len:
                s.token_ids[i, n] = event.token_id
            s.num_tokens[i] = n + 1
            if event.finished:
                finished[int(s.chan[i])] = (FINISH_CODES[event.finish_reason], 0)
                self._free(i)
        return finished

    def _free(self, i: int) -> None:
        """Release the slot's blocks (BlockAllocator.free order), publish `done`, mark it FREE."""
        s = self.state
        nb, top = int(s.num_blocks[i]), int(s.free_top)
        s.free_blocks[top : top + nb] = s.block_table[i, :nb].flip(0)
        s.free_top[0] = top + nb
        s.block_table[i] = -1
        s.num_blocks[i] = 0
        chan = int(self.state.chan[i])
        self.dev_region.store_progress(chan, "done", int(self.state.generation[i]))
        self.state.slot_state[i] = SlotState.FREE
        self.state.num_active[0] -= 1
        self.state.finish_reason[i] = 0
        self.state.error_code[i] = 0


def derived_seed(request_id: int) -> int:
    """docs/device_loop.md: rng.row_keys(engine_seed, request_id) with the top bit cleared."""
    key = row_keys(torch.tensor([ENGINE_SEED]), torch.tensor([request_id]))
    return int(key[0]) & (2**63 - 1)


def prompt(n: int, salt: int) -> list[int]:
    return [3 + (salt * 37 + i * 11) % 500 for i in range(n)]


# -- tests ----------------------------------------------------------------------------------------------
def mixed_workload(t: Twin) -> None:
    """Different prompt lengths and priorities, seeded and unseeded sampling, arrivals while decoding,
    a cancel, and a KV cache small enough that running requests get preempted."""
    greedy = SamplingParams(temperature=0.0, max_tokens=6)
    t.front.submit(prompt(10, 1), greedy)
    t.front.submit(prompt(5, 2), SamplingParams(temperature=0.8, top_k=20, seed=99, max_tokens=5))
    t.front.submit(
        prompt(20, 3), SamplingParams(temperature=0.7, top_p=0.9, min_p=0.05, max_tokens=4), priority=1
    )
    t.step()
    t.step()
    late = t.front.submit(prompt(7, 4), SamplingParams(temperature=1.0, max_tokens=8))  # unseeded
    t.front.submit(prompt(3, 5), greedy, priority=-1)
    t.step()
    t.front.submit(prompt(14, 6), SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True))
    t.step()
    t.step()
    t.front.cancel(late)
    t.step()
    t.front.submit(prompt(25, 7), SamplingParams(temperature=0.0, max_tokens=5), priority=1)
    t.front.submit(prompt(2, 8), greedy)
    t.run_until_idle()
    t.step()  # idle: no forward
    st = t.stats
    assert st.preemptions > 0, "the workload must force preemption"
    assert st.admitted_while_running > 0
    assert st.last_finish(late.channel) == (FINISH_CODES[FinishReason.ABORT], 0), (
        "the cancel must have landed"
    )
    assert int(t.state.free_top) == LOOP.num_kv_blocks and int(t.state.num_active) == 0
    counters = t.state.counters.tolist()
    assert (
        counters[COUNTER_INDEX["steps"]] == st.steps and counters[COUNTER_INDEX["step_tokens"]] == st.tokens
    )
    assert counters[COUNTER_INDEX["loop_iterations"]] == st.iterations > st.steps


def test_mixed_workload_matches_reference_step_by_step():
    mixed_workload(Twin())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (captures the launch in a graph)")
def test_mixed_workload_replayed_from_a_cuda_graph():
    """launch() captured once and replayed: it reads nothing on the host and allocates nothing."""
    mixed_workload(Twin(cuda_graph=True))


def test_priority_beats_arrival_but_never_preempts():
    t = Twin()
    subs = [
        t.front.submit(prompt(3, 10 + i), SamplingParams(temperature=0.0, max_tokens=3 + i))
        for i in range(LOOP.max_num_seqs + 1)  # one more than fits in a step: the last one waits
    ]
    t.step()
    low = t.front.submit(prompt(4, 20), SamplingParams(temperature=0.0, max_tokens=2), priority=5)
    urgent = t.front.submit(prompt(4, 21), SamplingParams(temperature=0.0, max_tokens=2), priority=-3)
    order: list[int] = []
    for _ in range(12):
        ref = t.step()
        order += [c.request_id for c in ref.chunks if c.start == 0 and c.request_id not in order]
    # The urgent one overtakes the earlier waiting one once a sequence finishes; nothing is preempted.
    assert order.index(urgent.request_id) < order.index(subs[-1].request_id) < order.index(low.request_id)
    assert t.engine.scheduler.num_preemptions == 0
    t.run_until_idle()


BAD_RECORDS: list[tuple[str, dict[str, object], list[int] | None]] = [
    ("prompt_len 0", {"prompt_len": 0}, None),
    ("prompt_len over max_prompt_tokens", {"prompt_len": RING.max_prompt_tokens + 1}, None),
    ("token out of vocab", {}, [5, 6, 512, 7]),
    ("negative token", {}, [5, -1]),
    ("n_stop too large", {"n_stop": RING.max_stop_ids + 1}, None),
    ("stop id out of vocab", {"n_stop": 1, "stop_ids": [600, 0, 0, 0]}, None),
    ("max_tokens 0", {"max_tokens": 0}, None),
    ("max_tokens over the channel", {"max_tokens": RING.max_output_tokens + 1}, None),
    ("prompt below arena_tail", {"prompt_offset": 0, "arena_end": 4}, None),  # space already released
    ("has_seed 2", {"has_seed": 2}, None),
    ("ignore_eos 3", {"ignore_eos": 3}, None),
    ("temperature nan", {"temperature": float("nan")}, None),
    ("temperature negative", {"temperature": -0.5}, None),
    ("top_p 0", {"top_p": 0.0}, None),
    ("top_p inf", {"top_p": float("inf")}, None),
    ("top_k negative", {"top_k": -2}, None),
    ("min_p above 1", {"min_p": 1.5}, None),
    ("seed beyond 2**63", {"has_seed": 1, "seed": 2**63 + 5}, None),
    ("longer than max_model_len", {}, prompt(LOOP.max_model_len + 1, 9)),
    # Last of its group: releasing the arena up to a bogus arena_end releases everything published
    # (clamped to arena_head), so records behind it in the same ring pass fail the arena check too.
    ("arena_end inconsistent", {"arena_end": 10**6}, None),
]


def test_rejected_records_get_engine_servers_error_codes():
    t = Twin()
    for i in range(0, len(BAD_RECORDS), 5):  # a few per iteration: each takes a slot until commit
        for _, fields, tokens in BAD_RECORDS[i : i + 5]:
            t.front.submit(tokens or prompt(4, i), record=fields)
        t.step()
    codes = [code for _, reason, code in t.stats.finishes if reason == FINISH_CODES[FinishReason.ERROR]]
    assert len(codes) == len(BAD_RECORDS)
    assert set(codes) == {
        ErrorCode.PROMPT_LENGTH, ErrorCode.BAD_RECORD, ErrorCode.TOKEN_OUT_OF_VOCAB, ErrorCode.STOP_IDS,
        ErrorCode.MAX_TOKENS, ErrorCode.INVALID_PARAMS, ErrorCode.ENGINE_REJECTED,
    }  # fmt: skip
    assert int(t.state.counters[COUNTER_INDEX["requests_rejected"]]) == len(BAD_RECORDS)
    # The loop keeps serving after all that.
    t.front.submit(prompt(6, 1), SamplingParams(temperature=0.0, max_tokens=3))
    t.run_until_idle()


def test_duplicates_unaddressable_records_and_cancel_before_admission():
    t = Twin()
    live = t.front.submit(prompt(6, 1), SamplingParams(temperature=0.0, max_tokens=8))
    t.step()
    t.front.submit(prompt(3, 2), request_id=live.request_id)  # same id as a live request: BAD_RECORD
    t.front.submit(prompt(3, 3), record={"slot": RING.max_inflight + 3})  # no such channel: skipped
    t.front.submit(prompt(3, 4), record={"generation": 0})  # not the channel's generation: skipped
    doomed = t.front.submit(prompt(3, 5))
    t.front.cancel(doomed)  # cancelled before the engine read the record: ABORT, never admitted
    t.step()
    assert int(t.state.counters[COUNTER_INDEX["records_unaddressable"]]) == 2
    assert t.stats.last_finish(doomed.channel) == (FINISH_CODES[FinishReason.ABORT], 0)
    # A bad prompt frees its id: the same id right after is admitted (engine_server never held it).
    bad = t.front.submit([1, 1000], request_id=500)
    t.step()
    assert t.stats.last_finish(bad.channel) == (
        FINISH_CODES[FinishReason.ERROR],
        ErrorCode.TOKEN_OUT_OF_VOCAB,
    )
    t.front.submit(prompt(3, 6), request_id=500)
    t.step()
    assert 500 in [q.request_id for q in t.engine.scheduler.running]
    t.front.cancel(live)
    t.run_until_idle()


def test_shutdown_finishes_everything_and_returns_every_block():
    t = Twin()
    for i in range(RING.max_inflight - 1):  # one channel left for a record queued after shutdown
        t.front.submit(prompt(9, i), SamplingParams(temperature=0.0, max_tokens=10))
    for _ in range(4):
        t.step()
    assert int(t.state.free_top) < LOOP.num_kv_blocks
    t.front.shutdown()
    tail = t.dev_region.load("req_tail")
    queued = t.front.submit(prompt(3, 9))  # after the shutdown word: left in the ring for the host
    t.launch()
    s = t.state
    live = [i for i in range(LOOP.num_slots) if int(s.slot_state[i]) != SlotState.FREE]
    assert live and all(int(s.slot_state[i]) == SlotState.FINISHING for i in live)
    assert {(int(s.finish_reason[i]), int(s.error_code[i])) for i in live} == {
        (FINISH_CODES[FinishReason.ABORT], ErrorCode.SHUTDOWN)
    }
    assert int(s.free_top) == LOOP.num_kv_blocks and sorted(s.free_blocks.tolist()) == list(range(10))
    assert (s.block_table == -1).all() and (s.num_blocks == 0).all()
    assert int(s.shutdown_seen) == 1 and int(s.step_num_tokens) == 0
    assert int(s.bucket_index) == len(LOOP.buckets) and (s.sample_slot == -1).all()
    assert t.dev_region.load("req_tail") == tail and t.dev_region.record_seq(tail) == tail + 1
    assert queued.channel not in [int(s.chan[i]) for i in live]
    # The reference aborts the same requests.
    ref, _ = t._reference_iteration()
    finished_dev = t._device_commit([])
    shut = {
        c for c in range(RING.max_inflight) if t.ref_region.read_status(c)["error_code"] == ErrorCode.SHUTDOWN
    }
    assert set(finished_dev) == shut - {queued.channel}


def test_records_beyond_free_slots_wait_in_the_ring():
    loop = LoopGeometry(
        num_slots=4, max_num_seqs=2, max_num_batched_tokens=8, buckets=(8,), block_size=4, num_kv_blocks=32,
        max_model_len=32, max_stop_ids=4, vocab_size=512, eos_token_ids=(2,),
    )  # fmt: skip
    t = Twin(loop, check_slot_is_channel=False)
    for i in range(6):
        t.front.submit(prompt(3, i))
    t.launch()
    assert t.dev_region.load("req_tail") == 4  # one record per free slot
    assert int(t.state.counters[COUNTER_INDEX["requests_admitted"]]) == 4
    assert int(t.state.num_active) == 4
    t._free(0)
    t._free(3)
    t.launch()
    assert t.dev_region.load("req_tail") == 6
    assert sorted(t.state.request_id.tolist()) == [2, 3, 5, 6]


def test_launch_is_capturable_by_construction():
    """No host sync, allocation or host-visible value in the launch path (a CUDA graph replays it)."""
    launch = inspect.getsource(DeviceScheduler.launch)
    body = launch.split('"""')[-1]
    assert "schedule_kernel[(1,)](*self._args, **self._constants" in body
    assert not re.search(r"\.item\(|\.tolist\(|\.cpu\(|torch\.|int\(|float\(|synchronize|if |for ", body)
    kernel_module = inspect.getsource(schedule_module)
    assert not re.search(r"\.item\(|\.tolist\(|synchronize", kernel_module)


_COMPILE_FOR_H100 = """
import torch, triton
from triton.backends.compiler import GPUTarget
from blink_appliance.engine.device_scheduler import DeviceScheduler
from blink_appliance.engine.device_state import DeviceState
from blink_appliance.kernels.schedule import schedule_kernel
from blink_appliance.model.gpu_forward import StepInputs
from blink_appliance.transport.ring_layout import RingLayout
from tests.test_device_scheduler import LOOP, RING

layout = RingLayout.of(RING)
ring = torch.zeros(layout.size, dtype=torch.uint8)
inputs = StepInputs.allocate(LOOP.max_num_batched_tokens, LOOP.max_num_seqs, LOOP.max_blocks_per_seq, "cpu")
sched = DeviceScheduler(LOOP, DeviceState.allocate(LOOP, "cpu"), ring, layout, inputs, 1)
types = {torch.int32: "*i32", torch.int64: "*i64", torch.float32: "*fp32", torch.uint8: "*u8"}
constants = dict(sched._constants, RING_ASM=True)
args = iter(sched._args)
signature = {}
for name in schedule_kernel.arg_names:
    if name in constants:
        signature[name] = "constexpr"
    else:
        a = next(args)
        signature[name] = types[a.dtype] if isinstance(a, torch.Tensor) else "i64"
compiled = triton.compile(
    triton.compiler.ASTSource(fn=schedule_kernel, signature=signature, constexprs=constants),
    target=GPUTarget("cuda", 90, 32),
    options={"num_warps": sched.num_warps},
)
ptx = compiled.asm["ptx"]
print("acquire", ptx.count("ld.acquire.sys.global.u64"), "release", ptx.count("st.release.sys.global.u64"),
      "local", ptx.count(".local"))
"""


def test_kernel_compiles_for_the_h100():
    """The GPU path (inline PTX acquire/release on the ring) compiles for sm_90 here, without a GPU:
    the interpreter does not type-check the way the compiler does. Run in a child process, since
    TRITON_INTERPRET is set in this one."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    done = subprocess.run(
        [sys.executable, "-c", _COMPILE_FOR_H100], cwd=Path(__file__).parent.parent, env=env,
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    if done.returncode and (
        "ptxas" in done.stderr or "No module named 'triton.backends.nvidia" in done.stderr
    ):
        pytest.skip(f"no CUDA compiler backend in this install: {done.stderr[-300:]}")
    assert done.returncode == 0, done.stderr[-3000:]
    # One acquire (the records' seq words), two releases (req_tail, arena_tail), no register spills.
    assert done.stdout.split() == ["acquire", "1", "release", "2", "local", "0"], done.stdout


def test_engine_seed_is_checked():
    t = Twin()
    with pytest.raises(ValueError, match="engine_seed"):
        DeviceScheduler(LOOP, t.state, torch.frombuffer(t.dev_transport.buffer, dtype=torch.uint8),
                        RingLayout.of(RING), t.inputs, -1)  # fmt: skip
