"""Continuous batching with a token budget per step, chunked prefill, priority classes and
preemption by recompute.

One call to `schedule()` decides one model step (docs/engine.md has the full state machine):

0. Class cap (`lower_class_limit` = L >= 0; -1: none): of the running sequences of a class below the
   most urgent running class, only the first L in running order run this step; the others are held
   (they keep their blocks and get no tokens, so they resume without recompute once the urgent class
   is gone; phases 2-3 preempt them first, being last in running order).
   Best-effort turns (`best_effort_batch` = K >= 1; -1: none): of the running sequences of a class >=
   `best_effort_priority` (n of them, in running order), only K step, a window that moves K places a
   step (rank r steps when (r - clock * K) mod n < K); the others are held likewise, so one step of
   best-effort work, which an urgent arrival waits out, stays short.
1. Running sequences in running order: (class, admission), the class being the effective priority a
   sequence was admitted with, those held in 0 left out. One with a single uncomputed token
   (decoding) gets that token. One
   still prefilling gets a chunk of what the budget has left after reserving one token for every
   decoding sequence not yet visited, so decodes never starve behind a long prompt.
2. Every scheduled chunk gets the KV blocks it writes into. When the free list is short, the running
   sequence last in running order (lowest class, most recently admitted) is preempted (blocks freed,
   computed count reset to 0, back into the waiting queue with its generated tokens kept, to be
   recomputed), until the chunk fits or the sequence being scheduled is itself the victim.
3. If nothing was preempted in 1-2, waiting sequences are admitted in (effective priority, arrival)
   order. When the head does not fit (no sequence slot, no budget, too few blocks) and the last
   running sequence is of a strictly lower class, that one is preempted (its chunk of this step
   taken back) and the head tried again. Admission stops at the first head that still does not
   fit, that this step preempted, or, with a cap, that is of a class below the most urgent running
   one while L such sequences run, held ones counted (no skipping, so FCFS holds within a class).
   With a cap, the running sequences that phase 0 would hold now (this step's admissions counted)
   give their chunk of this step back, keeping the blocks it took.
4. Aging (`priority_aging_steps` > 0): a waiting sequence's effective priority improves by one per
   that many steps waited, never past the most urgent base priority among live sequences.
5. Prefix cache (`prefix_cache`): an admitted sequence starts with the cached blocks of its longest
   cached prompt prefix (at most (tokens - 1) // block_size of them, so one token is always fed; none
   for one with prompt positions left to score) and prefills the rest; after 1-3, every block a chunk
   of this step fills is registered under its prompt block hash (docs/engine.md, "Prefix cache").
6. Prompt scoring: a sequence with prompt positions left to score (prompt logprobs) prefills at most
   `prompt_score_chunk` tokens a step, and only one such sequence prefills per step: the first in
   running order, not held, that is prefilling when the step starts, else the first such head admission takes
   (a later scoring head stops admission). The GPU loop gathers the scored rows of that one chunk
   into a buffer of `prompt_score_chunk` rows.

A sequence samples in this step exactly when its chunk ends at its last token.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

import torch

from blink_appliance.engine.reference.block_allocator import BlockAllocator
from blink_appliance.engine.reference.sequence import Sequence, SequenceStatus
from blink_appliance.model.kv_cache import ForwardBatch


@dataclass(frozen=True)
class SchedulerConfig:
    block_size: int
    max_num_seqs: int
    max_num_batched_tokens: int
    priority_aging_steps: int = 0  # 0: no aging
    lower_class_limit: int = -1  # lower-class running sequences that run beside the top class; -1: no cap
    prefix_cache: bool = False  # admissions reuse cached prompt blocks; filled blocks are registered
    prompt_score_chunk: int = 512  # tokens a prompt-scoring sequence prefills per step, at most (phase 6)
    best_effort_batch: int = -1  # best-effort running sequences that step at once, taking turns; -1: all
    best_effort_priority: int = 1  # classes at or past this one are best effort (phase 0)


@dataclass
class ScheduledChunk:
    seq: Sequence
    start: int  # first position fed this step (= num_computed_tokens before the step)
    num_tokens: int
    samples: bool = field(init=False)  # the chunk ends at the sequence's last token: the step samples

    def __post_init__(self) -> None:
        self.samples = self.end == self.seq.num_tokens

    @property
    def end(self) -> int:
        return self.start + self.num_tokens


@dataclass
class SchedulerOutput:
    chunks: list[ScheduledChunk]  # in batch order
    preempted: list[Sequence]  # in preemption order: budget fill, admission
    held: int = 0  # running sequences the class cap held this step (phase 0)

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)

    @property
    def sampling_chunks(self) -> list[ScheduledChunk]:
        return [c for c in self.chunks if c.samples]


class Scheduler:
    def __init__(self, config: SchedulerConfig, allocator: BlockAllocator) -> None:
        self.config = config
        self.allocator = allocator
        self.waiting: list[Sequence] = []  # sorted by base (priority, arrival)
        self.running: list[Sequence] = []  # in running order (Sequence.run_key); the last is the next victim
        self.num_preemptions = 0
        self.clock = 0  # steps scheduled so far (schedule() calls that produced chunks): aging's clock
        self._next_run_order = 0
        self.prefix_queries = 0  # tokens of the admissions that looked the cache up
        self.prefix_hits = 0  # of those, tokens found cached

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        seq.wait_since = self.clock
        bisect.insort(self.waiting, seq, key=lambda s: s.queue_key)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.config.block_size)

    def effective_priority(self, seq: Sequence, floor: int) -> int:
        """A waiting sequence's priority now: one better per `priority_aging_steps` steps waited since
        it last entered the queue, never better than `floor` (the most urgent live base priority)."""
        every = self.config.priority_aging_steps
        if every == 0:
            return seq.priority
        return max(floor, seq.priority - (self.clock - seq.wait_since) // every)

    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        chunks: list[ScheduledChunk] = []
        preempted: list[Sequence] = []

        # 0: the class cap holds the lower classes' sequences beyond the first L, and best-effort
        # sequences wait for their turn.
        held = self._held() | self._waiting_turn()

        # 1 + 2: running sequences in running order.
        reserved = sum(1 for s in self.running if s.num_uncomputed_tokens == 1 and id(s) not in held)
        scorer = next(
            (
                s
                for s in self.running
                if s.scores_prompt and s.num_uncomputed_tokens > 1 and id(s) not in held
            ),
            None,
        )
        i = 0
        while i < len(self.running):
            seq = self.running[i]
            remaining = seq.num_uncomputed_tokens
            if id(seq) in held:
                i += 1
                continue
            if remaining == 1:
                reserved -= 1
                n = 1
            else:
                n = min(self._chunk_cap(seq, remaining), budget - reserved)
                if n <= 0 or (seq.scores_prompt and seq is not scorer):
                    i += 1
                    continue
            # (A chunk taken back by phase 3 leaves its blocks allocated: none may be needed now.)
            need = max(0, self.blocks_for(seq.num_computed_tokens + n) - len(seq.block_table))
            while not self.allocator.can_allocate(need):
                victim = self.running[-1]
                if victim is not seq and victim.num_uncomputed_tokens == 1 and id(victim) not in held:
                    reserved -= 1  # its reserved decode token is no longer needed
                self.preempt(victim)
                preempted.append(victim)
                if victim is seq:
                    break
            if seq.status is not SequenceStatus.RUNNING:
                continue  # preempted itself; running[i] is now the next sequence
            seq.block_table.extend(self.allocator.allocate(need))
            chunks.append(ScheduledChunk(seq, seq.num_computed_tokens, n))
            budget -= n
            i += 1

        # 3: admit waiting sequences (not in a step that had to preempt for blocks: that would thrash).
        if not preempted and self.waiting:
            self._admit(chunks, preempted, budget, scorer is not None)
            # An admission of a more urgent class holds the lower classes from this step on: the
            # running ones beyond the cap give their chunk back (their blocks stay theirs).
            again = self._held() - held
            if again:
                chunks[:] = [c for c in chunks if id(c.seq) not in again]
                held |= again
        if chunks:
            self.clock += 1
        if self.config.prefix_cache:
            self._register_filled(chunks)
        return SchedulerOutput(chunks, preempted, sum(1 for s in self.running if id(s) in held))

    def _chunk_cap(self, seq: Sequence, tokens: int) -> int:
        """Tokens a prefill chunk of `seq` may take of `tokens` (phase 6)."""
        return min(tokens, self.config.prompt_score_chunk) if seq.scores_prompt else tokens

    def _cached_prefix(self, seq: Sequence) -> list[int]:
        """The cached blocks a waiting sequence would start with (phase 5)."""
        if not self.config.prefix_cache or seq.scores_prompt:
            return []
        limit = min(len(seq.block_hashes), (seq.num_tokens - 1) // self.config.block_size)
        return self.allocator.lookup(seq.block_hashes, limit)

    def _register_filled(self, chunks: list[ScheduledChunk]) -> None:
        """Cache the prompt blocks this step's chunks fill, in batch order (their KV is written by this
        step's forward, before any later step can look them up)."""
        bs = self.config.block_size
        for c in chunks:
            for j in range(c.start // bs, min(c.end // bs, len(c.seq.block_hashes))):
                self.allocator.register(c.seq.block_table[j], c.seq.block_hashes[j])

    def _lower_class_count(self) -> int:
        """Running sequences of a class strictly below (greater than) the most urgent running one."""
        top = self.running[0].run_priority  # the running list is in running order: class first
        return sum(1 for s in self.running if s.run_priority > top)

    def _held(self) -> set[int]:
        """Phase 0: ids of the running sequences of a lower class than the most urgent running one
        beyond the first `lower_class_limit` of them (the tail of the running order)."""
        limit = self.config.lower_class_limit
        if limit < 0 or not self.running:
            return set()
        excess = self._lower_class_count() - limit
        return {id(s) for s in self.running[len(self.running) - excess :]} if excess > 0 else set()

    def _waiting_turn(self) -> set[int]:
        """Phase 0, best-effort turns: ids of the best-effort running sequences outside this step's
        window of `best_effort_batch` (ranks in running order, the window moving by that many a step)."""
        k = self.config.best_effort_batch
        best_effort = [s for s in self.running if s.run_priority >= self.config.best_effort_priority]
        n = len(best_effort)
        if k < 0 or n <= k:
            return set()
        start = self.clock * k % n
        return {id(s) for r, s in enumerate(best_effort) if (r - start) % n >= k}

    def _capped(self, priority: int) -> bool:
        """A head of this effective priority is of a lower class than the most urgent running one while
        `lower_class_limit` such sequences already run (this step's admissions counted)."""
        limit = self.config.lower_class_limit
        if limit < 0 or not self.running or priority <= self.running[0].run_priority:
            return False
        return self._lower_class_count() >= limit

    def _admit(
        self, chunks: list[ScheduledChunk], preempted: list[Sequence], budget: int, scoring: bool
    ) -> None:
        """Phase 3: the head of the (effective priority, arrival) order while it fits, preempting
        running sequences of a strictly lower class (last in running order first) to make it fit.
        `scoring`: a running sequence scores its prompt this step, so a scoring head waits (phase 6)."""
        floor = min(s.priority for s in self.running + self.waiting)
        while self.waiting:
            seq = min(self.waiting, key=lambda s: (self.effective_priority(s, floor), s.arrival))
            if any(seq is v for v in preempted):
                break  # preempted in this step (class cap, admission): not readmitted (recomputed) now
            priority = self.effective_priority(seq, floor)
            if self._capped(priority) or (scoring and seq.scores_prompt):
                break
            while not self._fits(seq, budget) and self.running and self.running[-1].run_priority > priority:
                victim = self.running[-1]
                for k, c in enumerate(chunks):
                    if c.seq is victim:  # its chunk of this step is taken back
                        budget += c.num_tokens
                        del chunks[k]
                        break
                self.preempt(victim)
                preempted.append(victim)
            if not self._fits(seq, budget):
                break
            hits, cached, n, need = self._first_chunk(seq, budget)
            self.waiting.remove(seq)
            seq.status = SequenceStatus.RUNNING
            self.allocator.acquire(hits)
            seq.block_table = hits + self.allocator.allocate(need)
            seq.num_computed_tokens = cached
            if self.config.prefix_cache:
                self.prefix_queries += seq.num_tokens
                self.prefix_hits += cached
            seq.run_priority = priority
            seq.run_order = self._next_run_order
            self._next_run_order += 1
            bisect.insort(self.running, seq, key=lambda s: s.run_key)
            chunks.append(ScheduledChunk(seq, cached, n))
            budget -= n
            scoring = scoring or seq.scores_prompt

    def _fits(self, seq: Sequence, budget: int) -> bool:
        """A free sequence slot, budget left, and free capacity for the blocks of its first chunk
        beyond its cached prefix and for the cached blocks it takes that nobody holds."""
        if len(self.running) >= self.config.max_num_seqs or budget <= 0:
            return False
        hits, _, _, need = self._first_chunk(seq, budget)
        return self.allocator.can_allocate(need + self.allocator.revived(hits))

    def _first_chunk(self, seq: Sequence, budget: int) -> tuple[list[int], int, int, int]:
        """A waiting head's first chunk: its cached blocks, the tokens they hold, the tokens it feeds
        and the blocks it needs beyond the cached ones."""
        hits = self._cached_prefix(seq)
        cached = len(hits) * self.config.block_size
        n = min(self._chunk_cap(seq, seq.num_tokens - cached), budget)
        return hits, cached, n, self.blocks_for(cached + n) - len(hits)

    def preempt(self, seq: Sequence) -> None:
        """Recompute preemption: drop the sequence's KV, requeue it with all its tokens to feed again."""
        self.running.remove(seq)
        self.allocator.free(seq.block_table)
        seq.block_table = []
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.add(seq)

    def finish(self, seq: Sequence) -> None:
        """Take a sequence out of the queues for good (stop, length or abort) and free its blocks."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
            self.allocator.free(seq.block_table)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        seq.block_table = []
        seq.status = SequenceStatus.FINISHED


def build_forward_batch(
    chunks: list[ScheduledChunk], block_size: int, device: torch.device | str
) -> ForwardBatch:
    """The ForwardBatch (docs/kv_layout.md) for a step's chunks, in the given order, without padding."""
    input_ids: list[int] = []
    positions: list[int] = []
    query_start = [0]
    context_lens: list[int] = []
    counts: list[int] = []
    sample_rows: list[int] = []
    for c in chunks:
        input_ids.extend(c.seq.token_ids[c.start : c.end])
        positions.extend(range(c.start, c.end))
        query_start.append(query_start[-1] + c.num_tokens)
        context_lens.append(c.end)
        counts.append(c.num_tokens)
        if c.samples:
            sample_rows.append(query_start[-1] - 1)
    width = max(len(c.seq.block_table) for c in chunks)
    tables = [c.seq.block_table + [-1] * (width - len(c.seq.block_table)) for c in chunks]

    pos = torch.tensor(positions, dtype=torch.int64)
    block_tables = torch.tensor(tables, dtype=torch.int32)
    seq_of_token = torch.repeat_interleave(torch.arange(len(chunks)), torch.tensor(counts))
    slot_mapping = (
        block_tables[seq_of_token, pos // block_size].to(torch.int64) * block_size + pos % block_size
    )
    return ForwardBatch(
        input_ids=torch.tensor(input_ids, dtype=torch.int64, device=device),
        positions=pos.to(device),
        slot_mapping=slot_mapping.to(device),
        query_start=torch.tensor(query_start, dtype=torch.int32, device=device),
        context_lens=torch.tensor(context_lens, dtype=torch.int32, device=device),
        block_tables=block_tables.to(device),
        sample_rows=torch.tensor(sample_rows, dtype=torch.int64, device=device),
    )
