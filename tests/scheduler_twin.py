"""The scheduler twin (no tests here): the CPU reference engine and DeviceScheduler fed the same
ring traffic and compared after every iteration, for the tests/test_device_scheduler*.py tests.

Two regions receive the same front-end writes (records, prompts, cancels, shutdown) with the bytes
EngineClient.submit writes. One is served by the reference: EngineServer's own admission and cancel
code over an LLMEngine (tiny random model), whose Scheduler/BlockAllocator decide each step. The other
is read by DeviceScheduler.launch() (Triton; on the CPU under TRITON_INTERPRET=1). After every
iteration the twin compares the step both made, chunk by chunk and block by block: scheduled
requests in order, chunk sizes, input ids, positions, slot mapping, block tables, sample rows and
their sampling parameters, the bucket, preemptions, running/waiting order, the free list, the ring's
consumer words, and the finish codes of cancelled / rejected / shut-down requests. The device side is
then committed by the twin with the reference's sampled tokens (what commit will do on the GPU).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace

import numpy as np
import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

from blink_appliance.kernels.constraint import advance_rows  # noqa: E402
from blink_appliance.kernels.sampling import (  # noqa: E402
    SAMPLER_GREEDY,
    SAMPLER_LOGPROBS,
    SAMPLER_PENALTIES,
    SAMPLER_REJECTION,
    SAMPLER_REJECTION_TOP_K,
    SAMPLER_REJECTION_TOP_K_TOP_P,
    SAMPLER_SCORE,
)

from blink_appliance.engine.loop.scheduler import DeviceScheduler  # noqa: E402
from blink_appliance.engine.loop.state import (  # noqa: E402
    COUNTER_INDEX,
    DeviceState,
    LoopGeometry,
    SlotState,
)
from blink_appliance.engine.reference.engine import EngineConfig, LLMEngine  # noqa: E402
from blink_appliance.engine.reference.model_runner import StepOutput, _prompt_positions  # noqa: E402
from blink_appliance.engine.reference.rng import row_keys  # noqa: E402
from blink_appliance.engine.reference.scheduler import SchedulerOutput, build_forward_batch  # noqa: E402
from blink_appliance.engine.reference.server import EngineServer  # noqa: E402
from blink_appliance.model.loaders import build_model, load_checkpoint  # noqa: E402
from blink_appliance.model.step_inputs import StepInputs  # noqa: E402
from blink_appliance.wire.region import RingRegion  # noqa: E402
from blink_appliance.wire.request import FinishReason, SamplingParams, TokenEvent  # noqa: E402
from blink_appliance.wire.ring_layout import FINISH_CODES, ErrorCode, RingLayout  # noqa: E402
from tests.twin_front_end import LOOP, RING, MemoryTransport, TwinFrontEnd  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ENGINE_SEED = 20261122


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
    preempted: list[int] = field(default_factory=list)  # request ids, in preemption order
    held: int = 0  # running sequences phase 0 held (class cap, best-effort turns)
    scored: list[tuple[object, int, list[int]]] = field(
        default_factory=list
    )  # (sequence, token row, positions)


@dataclass
class Stats:
    iterations: int = 0
    steps: int = 0
    tokens: int = 0
    preemptions: int = 0
    admitted_while_running: int = 0
    preempted_for_admission: int = 0  # steps whose admission preempted running sequences
    held: int = 0  # sequence-steps phase 0 held (lower_class_limit, best_effort_batch)
    finishes: list[tuple[int, int, int]] = field(default_factory=list)  # (channel, finish code, error code)

    def last_finish(self, channel: int) -> tuple[int, int]:
        return next((r, c) for ch, r, c in reversed(self.finishes) if ch == channel)


_MODEL = None
_MAPPED: list = []  # mapped ring buffers of this test's twins


@pytest.fixture(autouse=True)
def unmap_rings():
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
        self,
        loop: LoopGeometry = LOOP,
        *,
        check_slot_is_channel: bool = True,
        cuda_graph: bool = False,
        rank_tile: int | None = None,
    ) -> None:
        ring = replace(RING, prefix_block_size=loop.block_size) if loop.prefix_cache else RING
        layout = RingLayout.of(ring)
        self.loop = loop
        self.ref_transport, self.dev_transport = MemoryTransport(layout.size), MemoryTransport(layout.size)
        self.ref_region = RingRegion.create(self.ref_transport, ring)
        self.dev_region = RingRegion.create(self.dev_transport, ring)
        self.front = TwinFrontEnd([self.ref_region, self.dev_region])
        config = EngineConfig(
            block_size=loop.block_size, num_kv_blocks=loop.num_kv_blocks, max_num_seqs=loop.max_num_seqs,
            max_num_batched_tokens=loop.max_num_batched_tokens, max_model_len=loop.max_model_len, seed=7,
            priority_aging_steps=loop.priority_aging_steps, lower_class_limit=loop.lower_class_limit,
            prefix_cache=loop.prefix_cache, prompt_score_chunk=loop.prompt_score_chunk,
            best_effort_batch=loop.best_effort_batch, best_effort_priority=loop.best_effort_priority,
        )  # fmt: skip
        self.engine = LLMEngine(tiny_model(), config)
        self.server = EngineServer(self.engine, self.ref_transport, ring)
        self._captured: RefStep | None = None
        run = self.engine.runner.run

        def capture_then_run(out: SchedulerOutput) -> StepOutput:
            self._captured = self._snapshot(out)
            return run(out)

        self.engine.runner.run = capture_then_run
        self.state = DeviceState.allocate(loop, DEVICE)
        self.inputs = StepInputs.allocate(
            loop.max_num_batched_tokens, loop.max_num_seqs, loop.max_blocks_per_seq, DEVICE,
            loop.prompt_score_chunk,
        )  # fmt: skip
        if DEVICE == "cuda":  # the ring as the loop sees it: host memory mapped into the GPU
            from blink_appliance.engine.loop.mapped_region import MappedRegion

            self.mapped = MappedRegion(self.dev_transport.buffer, DEVICE)
            _MAPPED.append(self.mapped)
            ring = self.mapped.tensor(0, torch.uint8, layout.size)
        else:
            ring = torch.frombuffer(self.dev_transport.buffer, dtype=torch.uint8)
        # A tile of one puts each running sequence and block-table row in a tile of its own.
        tile = {} if rank_tile is None else {"rank_tile": rank_tile, "table_row_tile": rank_tile}
        self.ring, self.layout = ring, layout
        self.scheduler = DeviceScheduler(loop, self.state, ring, layout, self.inputs, ENGINE_SEED, **tile)
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
        scored, row = [], 0
        for c in out.chunks:
            positions = list(_prompt_positions(c))
            if positions:
                scored.append((c.seq, row + positions[0] - 1 - c.start, positions))
            row += c.num_tokens
        return RefStep(chunks, batch, sampling, [q.request_id for q in out.preempted], out.held, scored)

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
        self.stats.held += ref.held
        if running_before and any(c.start == 0 for c in ref.chunks[running_before:]):
            self.stats.admitted_while_running += 1
        # A step that preempted admits only through preemption by a higher class (docs/engine.md).
        if ref.preempted and any(c.start == 0 for c in ref.chunks):
            self.stats.preempted_for_admission += 1
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
        need = [
            SAMPLER_GREEDY
            if p.temperature == 0
            else SAMPLER_REJECTION_TOP_K_TOP_P
            if p.top_k > 0 and p.top_p < 1.0
            else SAMPLER_REJECTION_TOP_K
            if p.top_k > 0
            else SAMPLER_REJECTION
            for _, p, _, _ in ref.sampling
        ]
        logprobs = any(p.logprobs is not None for _, p, _, _ in ref.sampling)
        penalized = any(p.penalized or p.constraint is not None for _, p, _, _ in ref.sampling)
        assert int(s.sampler_index) == (
            max(need, default=SAMPLER_GREEDY)
            + SAMPLER_LOGPROBS * logprobs
            + SAMPLER_PENALTIES * penalized
            + SAMPLER_SCORE * bool(ref.scored)
        )
        self._compare_scored(ref, rid)
        for row, (_, params, _, _) in enumerate(ref.sampling):
            slot = sample_slots[row]
            assert int(s.lp_top_n[slot]) == (-1 if params.logprobs is None else params.logprobs)
            assert int(s.penalized[slot]) == params.penalized
            assert float(s.presence_penalty[slot]) == np.float32(params.presence_penalty)
            assert float(s.frequency_penalty[slot]) == np.float32(params.frequency_penalty)
            assert float(s.repetition_penalty[slot]) == np.float32(params.repetition_penalty)
            n = len(params.logit_bias)
            assert int(s.n_bias[slot]) == n
            assert s.bias_ids[slot, :n].tolist() == [t for t, _ in params.logit_bias]
            assert s.bias_values[slot, :n].tolist() == [float(np.float32(b)) for _, b in params.logit_bias]

    def _compare_scored(self, ref: RefStep, rid: list[int]) -> None:
        """The prompt positions the step scores: one sequence's at most, rows in step order."""
        s, P = self.state, self.loop.prompt_score_chunk
        assert len(ref.scored) <= 1, "the reference scored two sequences' prompts in one step"
        seq, row, positions = ref.scored[0] if ref.scored else (None, 0, [])
        n = len(positions)
        assert int(s.num_score_rows) == n
        assert self.inputs.score_rows.tolist() == [row + j for j in range(n)] + [-1] * (P - n)
        assert s.score_slot[n:].tolist() == [-1] * (P - n)
        if n:
            assert {rid[x] for x in s.score_slot[:n].tolist()} == {seq.request_id}
            assert s.score_token[:n].tolist() == [seq.token_ids[p] for p in positions]
            assert s.score_index[:n].tolist() == [p - seq.num_prompt_tokens for p in positions]
            assert s.score_temperature[:n].tolist() == [float(np.float32(seq.params.temperature))] * n

    def _compare_state(self) -> None:
        s, sched = self.state, self.engine.scheduler
        rid, state = s.request_id.tolist(), s.slot_state.tolist()
        slots = {
            rid[i]: i
            for i in range(self.loop.num_slots)
            if state[i] in (SlotState.WAITING, SlotState.RUNNING)
        }
        run_order, run_priority = s.run_order.tolist(), s.run_priority.tolist()
        running = sorted(
            (i for i in slots.values() if state[i] == SlotState.RUNNING),
            key=lambda i: (run_priority[i], run_order[i]),
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
            scored = seq.prompt_logprobs_next if seq.params.prompt_logprobs else seq.num_prompt_tokens
            assert int(s.lp_next[i]) == scored, "the next prompt position to score"
            constrained = seq.params.constraint is not None
            assert (int(s.c_offset[i]) >= 0) == constrained, "constrained or not"
            if constrained:
                assert int(s.c_state[i]) == seq.constraint_state, "the automaton's state"
            assert (
                s.token_ids[i, : min(seq.num_tokens, self.loop.max_model_len)].tolist()
                == seq.token_ids[: self.loop.max_model_len]
            )
            if any(q is seq for q in sched.running):
                assert int(s.run_priority[i]) == seq.run_priority, "class of a running sequence"
            else:
                assert int(s.wait_since[i]) == seq.wait_since, "when it entered the waiting queue"
            nb = int(s.num_blocks[i])
            assert s.block_table[i, :nb].tolist() == seq.block_table and (s.block_table[i, nb:] == -1).all()
            if self.check_slot_is_channel:
                assert int(s.chan[i]) == i, "test premise: slots and channels are both taken lowest-first"
        top = int(s.free_top)
        allocator = self.engine.allocator
        assert s.free_blocks[:top].tolist() == allocator._free, "free list (LIFO order included)"
        assert s.block_ref.tolist() == allocator._ref, "holders of each block"
        assert self.state.lru_order() == list(allocator._cached), "cached blocks nobody holds, in LRU order"
        table = {i: b for i, b in enumerate(s.cache_table.tolist()) if b >= 0}
        assert table == allocator._table, "the prefix cache's table"
        assert not self.state.problems()
        counters = s.counters.tolist()
        assert counters[COUNTER_INDEX["preemptions"]] == sched.num_preemptions
        assert counters[COUNTER_INDEX["steps"]] == sched.clock, "aging's step clock"
        for name in ("requests_admitted", "requests_rejected", "requests_cancelled", "records_unaddressable"):
            assert counters[COUNTER_INDEX[name]] == self.server._counters[name], name
        assert counters[COUNTER_INDEX["prefix_cache_queries"]] == sched.prefix_queries
        assert counters[COUNTER_INDEX["prefix_cache_hits"]] == sched.prefix_hits
        for word in ("req_tail", "arena_tail"):
            assert self.dev_region.load(word) == self.ref_region.load(word), word
        assert int(s.num_active) == sum(1 for x in s.slot_state.tolist() if x != SlotState.FREE)

    # -- the device side's commit (what the GPU commit kernel does; tokens from the reference) ------
    def _device_commit(self, events: list[TokenEvent]) -> dict[int, tuple[int, int]]:
        s = self.state
        by_request = {e.request_id: e for e in events if e.token_id is not None}
        finished: dict[int, tuple[int, int]] = {}
        # The sampler stage's last kernel: constrained slots move by their rows' tokens.
        rows = [int(s.sample_slot[r]) for r in range(self.loop.max_num_seqs)]
        for r, i in enumerate(rows):
            if i >= 0:
                s.sampled[r] = by_request[int(s.request_id[i])].token_id
        steps = self.loop.vocab_size.bit_length() + 1
        advance_rows(
            s.num_sample_rows,
            s.sample_slot,
            s.sampled,
            s.c_offset,
            s.c_state,
            s.constraint_arena,
            steps=steps,
        )
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
        head, tail, live = s.lru_words.tolist()
        for b in s.block_table[i, :nb].flip(0).tolist():  # kernels/prefix_cache.py release_one
            s.block_ref[b] -= 1
            if s.block_ref[b] == 0 and s.block_cached[b]:
                s.lru[tail % s.lru.numel()], s.lru_pos[b] = b, tail
                tail, live = tail + 1, live + 1
            elif s.block_ref[b] == 0:
                s.free_blocks[top], top = b, top + 1
        s.free_top[0] = top
        s.lru_words[1], s.lru_words[2] = tail, live
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
