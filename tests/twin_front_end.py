"""The front end of the scheduler twin tests (tests/scheduler_twin.py): the ring and loop geometry
both engines use, an in-memory region transport, and a front end that writes every request into
several regions with the bytes EngineClient.submit writes."""

from __future__ import annotations

import mmap
from dataclasses import dataclass

import numpy as np

from blink_appliance.engine.loop.state import LoopGeometry
from blink_appliance.wire.prefix_hash import arena_words
from blink_appliance.wire.region import RingRegion
from blink_appliance.wire.request import SamplingParams
from blink_appliance.wire.ring_layout import RingGeometry
from blink_appliance.wire.transport import Transport

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
        self.constraint_head = 0  # the next free word of the constraint area (never reused here)
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
        g = self.regions[0].geometry
        n = len(prompt)
        words = arena_words(prompt, g.prefix_block_size)  # its block hashes follow when the ring has them
        position = self.arena_head
        if position % g.arena_tokens + words.size > g.arena_tokens:
            position += g.arena_tokens - position % g.arena_tokens
        end = position + words.size
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
            r.write_prompt(position, words)
            r.store("arena_head", end)
            rec = r.request_record((rid, generation, chan, priority), (position, end, n), params)
            if params.constraint is not None:  # the automaton's words, as RequestAreas.open writes them
                automaton = params.constraint.to_words()
                r.write_constraint(self.constraint_head, automaton)
                rec[0]["constraint_offset"], rec[0]["constraint_len"] = (
                    self.constraint_head,
                    automaton.shape[0],
                )
            for name, value in (record or {}).items():
                rec[0][name] = value
            r.publish_record(self.head, rec)
            r.store("next_request_id", self.next_id)
            r.doorbell("req_head", self.head + 1)
        self.head += 1
        self.arena_head = end
        if params.constraint is not None:
            self.constraint_head += params.constraint.num_words
        return Submitted(rid, chan, generation)

    def cancel(self, sub: Submitted) -> None:
        for r in self.regions:
            r.store_ctl(sub.channel, "cancel", sub.generation)

    def shutdown(self) -> None:
        for r in self.regions:
            r.store("shutdown", 1)


def prompt(n: int, salt: int) -> list[int]:
    return [3 + (salt * 37 + i * 11) % 500 for i in range(n)]
