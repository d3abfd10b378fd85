"""The GPU loop over two tensor-parallel ranks: rank 0 leads, rank 1 follows its step plans
(docs/tensor_parallel.md; the words and kernels are kernels/plan_link.py).

Rank 0's body is the engine iteration with three launches added: `before_schedule` (rank 1 has
copied the last plan, so the step inputs may be rewritten), `after_schedule` (publish the plan) and
`after_commit` (tell rank 1 when the loop ends). Rank 1's body is `follower_body`: wait for a plan,
copy rank 0's step inputs and bucket, then run the same bucket of its own forward. The norms'
exchanges keep the two forwards in step; the plan words order the plans.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from blink_appliance.engine.loop.graph import BucketGraphs, RawGraph, Segment, Switch
from blink_appliance.kernels.plan_link import (
    LINK_WORDS,
    await_ack,
    await_plan,
    copy_words,
    finish_follow,
    publish_exit,
    publish_plan,
)
from blink_appliance.model.step_inputs import StepInputs


@dataclass
class PlanLink:
    """One rank's link words and its peer's (peer memory)."""

    words: torch.Tensor  # int32 [LINK_WORDS], this rank's
    peer_words: torch.Tensor

    @classmethod
    def pair(cls, leader: torch.device | str, follower: torch.device | str) -> tuple[PlanLink, PlanLink]:
        a = torch.zeros(LINK_WORDS, dtype=torch.int32, device=leader)
        b = torch.zeros(LINK_WORDS, dtype=torch.int32, device=follower)
        return cls(a, b), cls(b, a)

    # -- rank 0 -------------------------------------------------------------------------------------
    def before_schedule(self) -> None:
        await_ack(self.words)

    def after_schedule(self) -> None:
        publish_plan(self.words, self.peer_words)

    def after_commit(self, keep_running: torch.Tensor) -> None:
        publish_exit(keep_running, self.peer_words)

    # -- rank 1 -------------------------------------------------------------------------------------
    def follow(
        self,
        leader_inputs: StepInputs,
        inputs: StepInputs,
        leader_bucket: torch.Tensor,
        bucket: torch.Tensor,
        keep_running: torch.Tensor,
        no_bucket: int,
    ) -> None:
        """Wait for rank 0's next plan and copy it (or, once rank 0 ended, end: no forward)."""
        await_plan(self.words)
        for f in fields(StepInputs):
            copy_words(getattr(leader_inputs, f.name), getattr(inputs, f.name))
        copy_words(leader_bucket, bucket)
        finish_follow(self.words, self.peer_words, keep_running, bucket, no_bucket)


def leader_body(link: PlanLink, body: list[Segment], keep_running: torch.Tensor) -> list[Segment]:
    """Rank 0's engine iteration (graph.engine_body's) with the plan published around its schedule."""
    schedule, *rest = body
    return [
        link.before_schedule,
        schedule,
        link.after_schedule,
        *rest,
        lambda: link.after_commit(keep_running),
    ]


def follower_body(
    link: PlanLink,
    leader_inputs: StepInputs,
    inputs: StepInputs,
    leader_bucket: torch.Tensor,
    bucket: torch.Tensor,
    keep_running: torch.Tensor,
    forward: BucketGraphs,
) -> list[Segment]:
    """Rank 1's iteration: follow rank 0's plan, then run that bucket of this rank's forward."""
    n = len(forward.buckets)
    return [
        lambda: link.follow(leader_inputs, inputs, leader_bucket, bucket, keep_running, n),
        Switch("bucket", bucket, [[RawGraph(forward.raw_cuda_graph(T))] for T in forward.buckets]),
    ]
