"""The scheduler on its own (no model): token budget, chunked prefill, priority, preemption, the batch."""

from __future__ import annotations

import itertools

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from blink_appliance.engine.reference.block_allocator import BlockAllocator
from blink_appliance.engine.reference.scheduler import (
    Scheduler,
    SchedulerConfig,
    SchedulerOutput,
    build_forward_batch,
)
from blink_appliance.engine.reference.sequence import Sequence, SequenceStatus
from blink_appliance.wire.request import SamplingParams

_arrival = itertools.count()


def make_seq(rid: int, prompt_len: int, priority: int = 0) -> Sequence:
    prompt = [(rid * 7 + i) % 100 + 3 for i in range(prompt_len)]
    return Sequence(rid, prompt, len(prompt), SamplingParams(), priority, next(_arrival), seed=rid)


def make(num_blocks=64, block_size=4, max_seqs=8, budget=32) -> Scheduler:
    return Scheduler(SchedulerConfig(block_size, max_seqs, budget), BlockAllocator(num_blocks))


def commit(out: SchedulerOutput, token: int = 5) -> None:
    """What the engine does after the forward: advance computed counts, append sampled tokens."""
    for c in out.chunks:
        c.seq.num_computed_tokens = c.end
    for c in out.sampling_chunks:
        c.seq.token_ids.append(token)


def plan(out: SchedulerOutput) -> list[tuple[int, int, int]]:
    return [(c.seq.request_id, c.start, c.num_tokens) for c in out.chunks]


def test_chunked_prefill_samples_only_on_the_last_chunk():
    s = make(budget=16)
    seq = make_seq(1, 40)
    s.add(seq)
    steps = []
    for _ in range(4):
        out = s.schedule()
        steps.append((plan(out), [c.seq.request_id for c in out.sampling_chunks]))
        commit(out)
    assert steps == [
        ([(1, 0, 16)], []),
        ([(1, 16, 16)], []),
        ([(1, 32, 8)], [1]),
        ([(1, 40, 1)], [1]),  # decode: the sampled token
    ]
    assert len(seq.block_table) == 11  # 41 tokens in blocks of 4


def test_decodes_get_a_token_each_and_prefill_takes_the_rest():
    s = make(budget=10)
    decoders = [make_seq(i, 3) for i in range(3)]
    for d in decoders:
        s.add(d)
    commit(s.schedule())  # all three prefilled in one step (9 tokens)
    long = make_seq(9, 50)
    s.add(long)
    out = s.schedule()
    assert plan(out) == [(0, 3, 1), (1, 3, 1), (2, 3, 1), (9, 0, 7)]
    assert out.num_tokens == 10
    commit(out)
    out = s.schedule()
    assert plan(out) == [(0, 4, 1), (1, 4, 1), (2, 4, 1), (9, 7, 7)]


def test_an_older_prefill_never_starves_younger_decoders():
    s = make(budget=8)
    long = make_seq(1, 30)
    s.add(long)
    commit(s.schedule())  # long: 8 of 30 computed, admitted first
    # A sequence admitted after `long` that is already decoding (as if `long` had been preempted and
    # readmitted around it): one computed prompt token plus the token it sampled.
    short = make_seq(2, 1)
    short.token_ids.append(7)
    short.num_computed_tokens = 1
    short.block_table = s.allocator.allocate(1)
    short.status = SequenceStatus.RUNNING
    s.running.append(short)
    out = s.schedule()
    assert plan(out) == [(1, 8, 7), (2, 1, 1)]  # one token of the budget kept for `short`


def test_priority_then_arrival_and_max_num_seqs():
    s = make(max_seqs=2, budget=64)
    a, b, c, d = make_seq(1, 4, 1), make_seq(2, 4, 0), make_seq(3, 4, 1), make_seq(4, 4, 0)
    for seq in (a, b, c, d):
        s.add(seq)
    out = s.schedule()
    assert [c.seq.request_id for c in out.chunks] == [2, 4]  # priority 0 first, FCFS within it
    assert [q.request_id for q in s.waiting] == [1, 3]


def test_admission_stops_at_the_first_request_that_does_not_fit():
    s = make(num_blocks=6, block_size=4, budget=64)
    s.add(make_seq(1, 20))  # 5 blocks
    s.add(make_seq(2, 8))  # 2 blocks: does not fit after the first
    s.add(make_seq(3, 4))  # 1 block: would fit, but FCFS does not skip
    out = s.schedule()
    assert plan(out) == [(1, 0, 20)]
    assert [q.request_id for q in s.waiting] == [2, 3]


def test_preemption_takes_the_youngest_and_recomputes_its_outputs():
    s = make(num_blocks=4, block_size=4, budget=64)
    a, b = make_seq(1, 7), make_seq(2, 8)  # 2 blocks each: the pool is full after admission
    s.add(a)
    s.add(b)
    commit(s.schedule(), token=11)
    assert s.allocator.num_free == 0
    # a's next token (position 7) still fits in its block; b's (position 8) needs a third block.
    out = s.schedule()
    assert plan(out) == [(1, 7, 1)]
    assert out.preempted == [b] and s.num_preemptions == 1
    assert b.status is SequenceStatus.WAITING and b.num_computed_tokens == 0 and b.block_table == []
    assert b.token_ids[-1] == 11 and b.num_tokens == 9  # its generated token is kept
    assert s.allocator.num_used == 2
    commit(out, token=12)
    s.finish(a)
    out = s.schedule()
    assert plan(out) == [(2, 0, 9)]  # recompute prompt + output, then sample the next token
    assert out.sampling_chunks[0].seq is b
    assert b.num_output_tokens == 1


def test_a_sequence_that_cannot_grow_preempts_itself_when_it_is_the_youngest():
    s = make(num_blocks=3, block_size=2, budget=64)
    a, b = make_seq(1, 3), make_seq(2, 2)
    s.add(a)
    s.add(b)
    commit(s.schedule())  # a: 2 blocks (3 tokens), b: 1 block (2 tokens) -> full
    commit(s.schedule())  # a decodes at pos 3 (its 2nd block); b at pos 2 needs a block -> preempted
    assert s.num_preemptions == 1 and [q.request_id for q in s.waiting] == [2]


def test_forward_batch_matches_the_layout():
    s = make(num_blocks=16, block_size=4, budget=12)
    a, b = make_seq(1, 6), make_seq(2, 9)
    s.add(a)
    s.add(b)
    out = s.schedule()
    assert plan(out) == [(1, 0, 6), (2, 0, 6)]
    batch = build_forward_batch(out.chunks, 4, "cpu")
    assert batch.input_ids.tolist() == a.token_ids + b.token_ids[:6]
    assert batch.positions.tolist() == list(range(6)) * 2
    assert batch.query_start.tolist() == [0, 6, 12]
    assert batch.context_lens.tolist() == [6, 6]
    assert batch.sample_rows.tolist() == [5]  # b's chunk does not end its prompt
    expected_slots = [a.block_table[p // 4] * 4 + p % 4 for p in range(6)] + [
        b.block_table[p // 4] * 4 + p % 4 for p in range(6)
    ]
    assert batch.slot_mapping.tolist() == expected_slots
    assert batch.block_tables.tolist() == [a.block_table, b.block_table]
    assert batch.block_tables.dtype == torch.int32 and batch.query_start.dtype == torch.int32
    assert batch.input_ids.dtype == batch.slot_mapping.dtype == batch.sample_rows.dtype == torch.int64


@settings(max_examples=40, deadline=None)
@given(
    prompts=st.lists(
        st.tuples(st.integers(1, 40), st.integers(1, 12), st.integers(0, 2)), min_size=1, max_size=10
    ),
    num_blocks=st.integers(10, 40),
    max_seqs=st.integers(1, 6),
    extra_budget=st.integers(0, 30),
)
def test_random_workloads_keep_every_invariant(prompts, num_blocks, max_seqs, extra_budget):
    block_size, budget = 4, max_seqs + extra_budget
    max_model_len = num_blocks * block_size  # the engine's rule: one sequence of max_model_len always fits
    s = make(num_blocks=num_blocks, block_size=block_size, max_seqs=max_seqs, budget=budget)
    seqs = {}
    for rid, (plen, max_out, prio) in enumerate(prompts):
        seqs[rid] = (make_seq(rid, min(plen, 40), prio), max_out)
        s.add(seqs[rid][0])
    for _ in range(2000):
        if not s.has_work():
            break
        running_before = [q for q in s.running if q.num_uncomputed_tokens == 1]
        out = s.schedule()
        assert out.chunks, "no progress"
        assert out.num_tokens <= budget
        assert len(s.running) <= max_seqs
        scheduled = {c.seq.request_id for c in out.chunks}
        assert len(scheduled) == len(out.chunks)
        for q in running_before:  # every decoder that was not preempted got its token
            assert q in out.preempted or q.request_id in scheduled
        for c in out.chunks:
            assert c.seq.status is SequenceStatus.RUNNING and c.start == c.seq.num_computed_tokens
            assert len(c.seq.block_table) == -(-c.end // block_size)
        held = [b for q in s.running for b in q.block_table]
        assert len(held) == len(set(held)) == s.allocator.num_used
        assert all(not q.block_table for q in s.waiting)
        commit(out)
        for c in out.sampling_chunks:
            seq, max_out = seqs[c.seq.request_id]
            if seq.num_output_tokens >= max_out or seq.num_tokens >= max_model_len:
                s.finish(seq)
    assert not s.has_work()
    assert s.allocator.num_used == 0
    for seq, max_out in seqs.values():
        assert seq.num_output_tokens == max_out or seq.num_tokens >= max_model_len


# -- priority classes: running order, preemption by admission, aging (docs/engine.md) ----------------


def running_ids(s: Scheduler) -> list[int]:
    return [q.request_id for q in s.running]


def test_prefill_budget_goes_to_the_higher_class_first_whatever_the_admission_order():
    s = make(num_blocks=64, block_size=4, max_seqs=4, budget=16)
    be, ls = make_seq(1, 40, priority=3), make_seq(2, 40, priority=0)
    for q, order in ((be, 0), (ls, 1)):  # both prefilling; be admitted first
        q.block_table = s.allocator.allocate(2)
        q.num_computed_tokens = 8
        q.status = SequenceStatus.RUNNING
        q.run_priority, q.run_order = q.priority, order
    s.running = sorted([be, ls], key=lambda q: q.run_key)
    assert running_ids(s) == [2, 1]
    out = s.schedule()
    assert plan(out) == [(2, 8, 16)] and out.preempted == []  # be waits for budget, keeps its blocks


def test_an_urgent_request_preempts_the_lowest_class_when_the_slots_are_full():
    s = make(num_blocks=64, max_seqs=2, budget=32)
    a, b = make_seq(1, 4, priority=3), make_seq(2, 4, priority=3)
    s.add(a)
    s.add(b)
    commit(s.schedule())
    urgent = make_seq(3, 4, priority=0)
    s.add(urgent)
    out = s.schedule()
    # b (last of the lowest class) is preempted, its decode chunk taken back; urgent runs first.
    assert out.preempted == [b] and b.status is SequenceStatus.WAITING and b.num_computed_tokens == 0
    assert plan(out) == [(1, 4, 1), (3, 0, 4)]
    assert running_ids(s) == [3, 1] and urgent.run_priority == 0
    assert b.wait_since == s.clock - 1 and s.allocator.num_used == 3


def test_no_preemption_within_a_class():
    s = make(num_blocks=64, max_seqs=2, budget=32)
    for rid in (1, 2, 3):
        s.add(make_seq(rid, 4, priority=1))
    for _ in range(3):
        commit(s.schedule())
    assert running_ids(s) == [1, 2] and [q.request_id for q in s.waiting] == [3]
    assert s.num_preemptions == 0


def test_an_urgent_request_preempts_when_the_budget_is_spent():
    s = make(num_blocks=64, block_size=4, max_seqs=4, budget=8)
    be = make_seq(1, 30, priority=3)
    s.add(be)
    commit(s.schedule())  # be: 8 of 30 computed
    urgent = make_seq(2, 5, priority=0)
    s.add(urgent)
    out = s.schedule()  # be's next prefill chunk takes the whole budget: urgent takes it back
    assert out.preempted == [be] and plan(out) == [(2, 0, 5)]
    assert be.num_computed_tokens == 0 and be.block_table == []
    commit(out)
    out = s.schedule()  # then be is readmitted after urgent's decode, and recomputes from 0
    assert plan(out) == [(2, 5, 1), (1, 0, 7)]


def test_an_urgent_request_preempts_when_the_blocks_are_short():
    s = make(num_blocks=6, block_size=4, max_seqs=4, budget=64)
    a, b = make_seq(1, 8, priority=3), make_seq(2, 8, priority=2)  # 2 blocks each
    s.add(a)
    s.add(b)
    commit(s.schedule())
    urgent = make_seq(3, 12, priority=0)  # 3 blocks; 2 are free
    s.add(urgent)
    out = s.schedule()
    # Victim: the last in running order, i.e. the lowest class (a, though admitted first); b stays.
    assert out.preempted == [a]
    assert plan(out) == [(2, 8, 1), (3, 0, 12)] and running_ids(s) == [3, 2]


def test_victims_go_lowest_class_first_then_youngest_and_stop_at_the_waiting_class():
    s = make(num_blocks=64, max_seqs=4, budget=64)
    seqs = [make_seq(1, 4, 2), make_seq(2, 4, 1), make_seq(3, 4, 2), make_seq(4, 4, 1)]
    for q in seqs:
        s.add(q)
    commit(s.schedule())
    assert running_ids(s) == [2, 4, 1, 3]  # class, then admission ((priority, arrival) order)
    first, second = make_seq(5, 4, 1), make_seq(6, 4, 0)
    s.add(first)
    s.add(second)
    out = s.schedule()
    # second (class 0) preempts 3, then first (class 1) preempts 1; they would not touch class 1.
    assert [q.request_id for q in out.preempted] == [3, 1]
    assert running_ids(s) == [6, 2, 4, 5]
    assert plan(out) == [(2, 4, 1), (4, 4, 1), (6, 0, 4), (5, 0, 4)]


def test_a_sequence_preempted_by_admission_is_not_readmitted_in_the_same_step():
    s = make(num_blocks=64, block_size=4, max_seqs=1, budget=64)
    be = make_seq(1, 4, priority=3)
    s.add(be)
    commit(s.schedule())
    s.add(make_seq(2, 4, priority=0))
    s.add(make_seq(3, 4, priority=3))
    out = s.schedule()
    assert out.preempted == [be] and plan(out) == [(2, 0, 4)]
    assert [q.request_id for q in s.waiting] == [1, 3]


def test_aging_promotes_a_starved_request_to_the_most_urgent_class_present():
    def run(aging: int) -> list[int]:
        s = Scheduler(SchedulerConfig(4, 1, 64, aging), BlockAllocator(64))
        be = make_seq(100, 4, priority=4)
        s.add(make_seq(1, 4, priority=0))
        s.add(be)
        admitted = []
        for step in range(12):
            s.add(make_seq(10 + step, 4, priority=0))  # a steady stream of class-0 requests
            out = s.schedule()
            admitted += [c.seq.request_id for c in out.chunks if c.start == 0]
            commit(out)
            for c in out.sampling_chunks:
                if c.seq.num_output_tokens >= 1:
                    s.finish(c.seq)
        return admitted

    assert 100 not in run(0), "without aging the class-4 request starves"
    admitted = run(2)
    # 8 steps waited = 4 levels, down to class 0 (the floor: the most urgent class present), where its
    # earlier arrival puts it ahead of the class-0 requests still waiting; it preempted nobody.
    assert admitted[:9] == [1, 10, 11, 12, 13, 14, 15, 16, 100]


def test_aging_is_off_by_default_and_a_preempted_sequence_restarts_at_its_base_priority():
    s = Scheduler(SchedulerConfig(4, 1, 64, 1), BlockAllocator(64))
    low = make_seq(1, 4, priority=5)
    s.add(make_seq(2, 4, priority=0))
    s.add(low)
    assert s.effective_priority(low, 0) == 5
    commit(s.schedule())
    commit(s.schedule())
    assert s.effective_priority(low, 0) == 3 and s.effective_priority(low, 4) == 4
    assert make().config.priority_aging_steps == 0


def _scoring_seq(rid: int, prompt_len: int) -> Sequence:
    seq = make_seq(rid, prompt_len)
    seq.params = SamplingParams(logprobs=0, prompt_logprobs=True)
    return seq


def _commit_scored(out: SchedulerOutput) -> None:
    """commit(), and the prompt positions the step scored, as LLMEngine.step counts them."""
    from blink_appliance.engine.reference.model_runner import _prompt_positions

    for c in out.chunks:
        c.seq.prompt_logprobs_next += len(_prompt_positions(c))
    commit(out)


def test_one_sequence_scores_its_prompt_per_step_in_chunks_of_at_most_prompt_score_chunk():
    s = Scheduler(SchedulerConfig(4, 8, 32, prompt_score_chunk=6), BlockAllocator(64))
    a, b, plain = _scoring_seq(1, 14), _scoring_seq(2, 5), make_seq(3, 9)
    for q in (a, b, plain):
        s.add(q)
    out = s.schedule()  # a is admitted and scores 6; b waits behind it, and so does plain (FCFS)
    assert [(c.seq.request_id, c.num_tokens) for c in out.chunks] == [(1, 6)]
    _commit_scored(out)
    out = s.schedule()
    assert [(c.seq.request_id, c.num_tokens) for c in out.chunks] == [(1, 6)]
    _commit_scored(out)
    out = s.schedule()  # a's last 2 tokens (it samples); b still waits: a scored this step
    assert [(c.seq.request_id, c.num_tokens) for c in out.chunks] == [(1, 2)] and out.chunks[0].samples
    _commit_scored(out)
    assert not a.scores_prompt and a.prompt_logprobs_next == 14
    out = s.schedule()  # a decodes; b scores all of its 5; plain comes in behind it
    assert [(c.seq.request_id, c.num_tokens) for c in out.chunks] == [(1, 1), (2, 5), (3, 9)]


def test_a_running_scorer_holds_the_other_running_scorers_back():
    s = Scheduler(SchedulerConfig(4, 8, 32, prompt_score_chunk=4), BlockAllocator(64))
    a, b = _scoring_seq(1, 10), _scoring_seq(2, 10)
    s.add(a)
    _commit_scored(s.schedule())
    s.add(b)
    out = s.schedule()  # b is a scoring head while a scores: admission stops at it
    assert [(c.seq.request_id, c.num_tokens) for c in out.chunks] == [(1, 4)]
    b.params = SamplingParams(logprobs=0)  # without prompt logprobs it would have come in
    s2 = Scheduler(SchedulerConfig(4, 8, 32, prompt_score_chunk=4), BlockAllocator(64))
    a2 = _scoring_seq(3, 10)
    s2.add(a2)
    _commit_scored(s2.schedule())
    s2.add(b)
    out = s2.schedule()
    assert [(c.seq.request_id, c.num_tokens) for c in out.chunks] == [(3, 4), (2, 10)]
