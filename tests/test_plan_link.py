"""Rank 1 follows rank 0's step plans (kernels/plan_link.py): every plan copied once, in order, none
rewritten before it was copied, and the follower stops when rank 0's loop ends.

Without a GPU the kernels run under Triton's interpreter and the two ranks are two forked processes
whose link words and inputs sit in shared memory.
"""

from __future__ import annotations

import multiprocessing
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

from blink_appliance.kernels.plan_link import (  # noqa: E402
    ACK,
    EXIT,
    LINK_WORDS,
    PLAN,
    SEQ,
    await_ack,
    await_plan,
    copy_words,
    finish_follow,
    publish_exit,
    publish_plan,
)

NO_BUCKET = 5


def _words():
    return torch.zeros(LINK_WORDS, dtype=torch.int32)


def test_one_plan_is_copied_and_acknowledged_then_the_exit_stops_the_follower():
    w0, w1 = _words(), _words()
    src = torch.arange(10, dtype=torch.int64)
    dst = torch.zeros(10, dtype=torch.int64)
    keep, bucket = torch.zeros(1, dtype=torch.int32), torch.tensor([2], dtype=torch.int32)
    await_ack(w0)  # nothing published yet: nothing to wait for
    publish_plan(w0, w1)
    assert (int(w0[SEQ]), int(w1[PLAN])) == (1, 1)
    await_plan(w1)
    copy_words(src, dst)
    finish_follow(w1, w0, keep, bucket, NO_BUCKET)
    assert torch.equal(src, dst) and (int(w1[SEQ]), int(w0[ACK]), int(keep), int(bucket)) == (1, 1, 1, 2)
    publish_exit(torch.ones(1, dtype=torch.int32), w1)  # still running: no exit
    assert int(w1[EXIT]) == 0
    publish_plan(w0, w1)  # a last plan, then the exit: the plan is still followed
    publish_exit(torch.zeros(1, dtype=torch.int32), w1)
    await_plan(w1)
    finish_follow(w1, w0, keep, bucket, NO_BUCKET)
    assert (int(keep), int(w0[ACK])) == (1, 2)
    await_plan(w1)  # wakes on the exit
    finish_follow(w1, w0, keep, bucket, NO_BUCKET)
    assert (int(keep), int(bucket)) == (0, NO_BUCKET)


def _rank0(w0, w1, plan, steps, keep):
    torch.set_num_threads(1)
    for k in range(1, steps + 1):
        await_ack(w0)
        plan.fill_(k)  # the schedule rewriting the inputs
        publish_plan(w0, w1)
    keep.zero_()
    publish_exit(keep, w1)


def _rank1(w1, w0, plan, queue):
    torch.set_num_threads(1)
    seen, copy = [], torch.zeros_like(plan)
    keep, bucket = torch.ones(1, dtype=torch.int32), torch.zeros(1, dtype=torch.int32)
    while int(keep):
        await_plan(w1)
        copy_words(plan, copy)
        finish_follow(w1, w0, keep, bucket, NO_BUCKET)
        if int(keep):
            seen.append(copy.tolist())
    queue.put(seen)


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU harness: two forked ranks under the interpreter")
def test_two_ranks_in_two_processes_see_every_plan_once_in_order():
    steps = 12
    w0, w1 = _words().share_memory_(), _words().share_memory_()
    plan = torch.zeros(64, dtype=torch.int64).share_memory_()
    keep = torch.ones(1, dtype=torch.int32).share_memory_()
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    procs = [
        ctx.Process(target=_rank0, args=(w0, w1, plan, steps, keep), daemon=True),
        ctx.Process(target=_rank1, args=(w1, w0, plan, queue), daemon=True),
    ]
    for p in procs:
        p.start()
    try:
        seen = queue.get(timeout=300)
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    assert seen == [[k] * 64 for k in range(1, steps + 1)]


def test_the_follower_copies_every_step_input_and_the_bucket():
    from dataclasses import fields

    from blink_appliance.engine.loop.plan_link import PlanLink
    from blink_appliance.model.step_inputs import StepInputs

    leader, follower = PlanLink.pair("cpu", "cpu")
    mine, theirs = (StepInputs.allocate(16, 4, 6, "cpu", score_rows=3) for _ in range(2))
    g = torch.Generator().manual_seed(0)
    for f in fields(StepInputs):
        t = getattr(theirs, f.name)
        t.copy_(torch.randint(-1, 1000, t.shape, generator=g))
    their_bucket, bucket = torch.tensor([3], dtype=torch.int32), torch.zeros(1, dtype=torch.int32)
    keep = torch.zeros(1, dtype=torch.int32)
    leader.before_schedule()
    leader.after_schedule()
    follower.follow(theirs, mine, their_bucket, bucket, keep, no_bucket=NO_BUCKET)
    assert all(torch.equal(getattr(mine, f.name), getattr(theirs, f.name)) for f in fields(StepInputs))
    assert (int(bucket), int(keep), int(leader.words[ACK])) == (3, 1, 1)
    leader.after_commit(torch.zeros(1, dtype=torch.int32))  # the leader's loop ended
    follower.follow(theirs, mine, their_bucket, bucket, keep, no_bucket=NO_BUCKET)
    assert (int(bucket), int(keep)) == (NO_BUCKET, 0)


def test_the_leader_publishes_around_its_schedule_and_after_its_commit():
    from blink_appliance.engine.loop.plan_link import PlanLink, leader_body

    calls = []
    link = PlanLink(_words(), _words())
    link.before_schedule = lambda: calls.append("await ack")
    link.after_schedule = lambda: calls.append("publish")
    link.after_commit = lambda keep: calls.append("exit?")
    body = leader_body(
        link, [lambda: calls.append("schedule"), lambda: calls.append("commit")], torch.ones(1)
    )
    for launch in body:
        launch()
    assert calls == ["await ack", "schedule", "publish", "commit", "exit?"]


class _FakeLoop:
    """A device loop stand-in: runs until `ends` polls have passed."""

    def __init__(self, name: str, log: list, ends: int) -> None:
        self.name, self.log, self.ends, self.polls, self.closed = name, log, ends, 0, False

    def launch(self) -> None:
        self.log.append(self.name)

    def running(self) -> bool:
        self.polls += 1
        return self.polls <= self.ends

    def close(self) -> None:
        self.closed = True


def test_linked_loops_launch_the_follower_first_and_run_until_both_end():
    """The follower must wait for the leader's first plan, so it is launched first; the pair runs
    while either loop does (the follower ends after the leader's exit)."""
    from blink_appliance.engine.loop.ranks import LinkedLoops

    log: list = []
    leader, follower = _FakeLoop("leader", log, ends=2), _FakeLoop("follower", log, ends=5)
    pair = LinkedLoops(leader, follower)
    pair.launch()
    assert log == ["follower", "leader"]
    assert not pair.join(timeout_s=0.0)  # still running: the follower has polls left
    assert pair.join(timeout_s=5.0, poll_s=0.0)
    assert follower.polls > 5 and leader.polls > 2
    pair.close()
    assert leader.closed and follower.closed
