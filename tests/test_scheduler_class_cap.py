"""The reference scheduler's class cap (lower_class_limit, docs/engine.md "Scheduling"): lower classes
beyond the cap are held (blocks kept, no tokens) while a more urgent class runs, from the step that
admits it on, and resume without recompute."""

from __future__ import annotations

from blink_appliance.engine.reference.block_allocator import BlockAllocator
from blink_appliance.engine.reference.scheduler import Scheduler, SchedulerConfig
from tests.test_scheduler import commit, make, make_seq, plan, running_ids


def make_capped(limit: int, max_seqs: int = 8) -> Scheduler:
    return Scheduler(SchedulerConfig(4, max_seqs, 32, lower_class_limit=limit), BlockAllocator(64))


def lower_class_running(s: Scheduler) -> int:
    top = min(q.run_priority for q in s.running)
    return sum(1 for q in s.running if q.run_priority > top)


def test_class_cap_holds_lower_classes_while_the_top_class_runs_and_they_resume_after():
    s = make_capped(2)
    low = [make_seq(rid, 4, priority=3) for rid in range(1, 6)]
    for q in low:
        s.add(q)
    commit(s.schedule())
    assert running_ids(s) == [1, 2, 3, 4, 5]  # one class: no cap
    urgent = make_seq(9, 4, priority=0)
    s.add(urgent)
    out = s.schedule()  # admitted: the last three lower-class ones give their chunk of this step back
    assert plan(out) == [(1, 4, 1), (2, 4, 1), (9, 0, 4)] and out.held == 3 and not out.preempted
    commit(out)
    for _ in range(3):
        out = s.schedule()
        # Phase 0: the last three lower-class sequences in running order are held, blocks and all.
        assert out.held == 3 and not out.preempted and running_ids(s) == [9, 1, 2, 3, 4, 5]
        assert [(rid, n) for rid, _, n in plan(out)] == [(9, 1), (1, 1), (2, 1)]
        commit(out)
    assert [q.num_computed_tokens for q in low] == [8, 8, 4, 4, 4]
    assert all(len(q.block_table) == 2 for q in low[2:])  # the block of the chunk they gave back
    s.finish(urgent)
    out = s.schedule()  # the top class is now the lower one: the held ones resume where they were
    assert out.held == 0 and plan(out) == [(1, 8, 1), (2, 8, 1), (3, 4, 1), (4, 4, 1), (5, 4, 1)]


def test_a_class_cap_of_zero_pauses_lower_classes_and_holds_their_heads():
    s = make_capped(0)
    for rid in (1, 2):
        s.add(make_seq(rid, 4, priority=3))
    commit(s.schedule())
    s.add(make_seq(9, 4, priority=0))
    commit(s.schedule())
    s.add(make_seq(3, 4, priority=3))
    out = s.schedule()
    assert plan(out) == [(9, 4, 1)] and out.held == 2 and [q.request_id for q in s.waiting] == [3]


def test_held_sequences_are_the_first_victims_of_a_more_urgent_admission():
    s = make_capped(1, max_seqs=3)
    for rid in (1, 2, 3):
        s.add(make_seq(rid, 4, priority=3))
    commit(s.schedule())
    s.add(make_seq(9, 4, priority=0))
    out = s.schedule()  # no sequence slot: the last in running order goes; 2 is held at once
    assert (
        [q.request_id for q in out.preempted] == [3] and plan(out) == [(1, 4, 1), (9, 0, 4)] and out.held == 1
    )
    commit(out)
    s.add(make_seq(10, 4, priority=-1))
    out = s.schedule()  # 2 is held, and it is the one that makes room; then 1 is held too
    assert [q.request_id for q in out.preempted] == [2] and out.held == 1
    assert plan(out) == [(9, 4, 1), (10, 0, 4)] and running_ids(s) == [10, 9, 1]
    commit(out)
    out = s.schedule()  # 10 is the top class now: 9 and 1 are both lower, one too many
    assert out.held == 1 and plan(out) == [(10, 4, 1), (9, 5, 1)] and not out.preempted


def test_admission_respects_the_class_cap_in_fcfs_order():
    s = make_capped(2)
    urgent = make_seq(9, 4, priority=0)
    s.add(urgent)
    commit(s.schedule())
    for rid in (1, 2, 3):
        s.add(make_seq(rid, 4, priority=3))
    s.add(make_seq(4, 4, priority=0))  # same class as the top: not capped, but FCFS by class
    out = s.schedule()
    assert plan(out) == [(9, 4, 1), (4, 0, 4), (1, 0, 4), (2, 0, 4)]  # 3 waits: two lower ones run
    assert lower_class_running(s) == 2 and [q.request_id for q in s.waiting] == [3]
    commit(out)
    s.finish(urgent)
    s.finish(next(q for q in s.running if q.request_id == 4))
    commit(s.schedule())
    assert running_ids(s) == [1, 2, 3]


def test_without_a_class_cap_lower_classes_fill_the_batch():
    for limit in (-1, 2):
        s = make_capped(limit)
        s.add(make_seq(9, 4, priority=0))
        commit(s.schedule())
        for rid in (1, 2, 3, 4):
            s.add(make_seq(rid, 4, priority=3))
        commit(s.schedule())
        assert lower_class_running(s) == (4 if limit < 0 else 2)
    assert make().config.lower_class_limit == -1


def make_turns(batch: int, limit: int = -1, max_seqs: int = 8) -> Scheduler:
    config = SchedulerConfig(4, max_seqs, 32, lower_class_limit=limit, best_effort_batch=batch)
    return Scheduler(config, BlockAllocator(64))


def test_best_effort_sequences_take_turns_in_a_moving_window():
    """best_effort_batch = 2 over five best-effort sequences: two step each step, the window moving
    by two (ranks 0-1, 2-3, 4 and 0, ...); an urgent one steps every step beside them."""
    s = make_turns(2)
    for rid in range(1, 6):
        s.add(make_seq(rid, 1, priority=1))
    s.add(make_seq(9, 1, priority=0))
    out = s.schedule()  # admission: every waiting one prefills its one token (turns hold running ones)
    assert out.held == 0 and len(plan(out)) == 6
    commit(out)
    stepped = []
    for _ in range(5):
        out = s.schedule()
        stepped.append(sorted(rid for rid, _, _ in plan(out)))
        assert out.held == 3 and not out.preempted
        commit(out)
    # clock 1..5: window starts 2, 4, 1, 3, 0 over ranks [1, 2, 3, 4, 5] (run order)
    assert stepped == [[3, 4, 9], [1, 5, 9], [2, 3, 9], [4, 5, 9], [1, 2, 9]]
    assert [q.num_computed_tokens for q in sorted(s.running, key=lambda q: q.request_id)] == [
        3,
        3,
        3,
        3,
        3,
        6,
    ]


def test_no_turns_while_the_best_effort_sequences_fit_the_batch_or_without_the_key():
    for s in (make_turns(5), make_turns(-1)):
        for rid in range(1, 6):
            s.add(make_seq(rid, 1, priority=3))
        commit(s.schedule())
        out = s.schedule()
        assert out.held == 0 and len(plan(out)) == 5
