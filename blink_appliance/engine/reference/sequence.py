"""Per-request state inside the engine: the tokens, how many of them are in the KV cache, the blocks.

A sequence's tokens are its prompt followed by what it generated. The engine only ever needs two
counters to know what to feed the model: `num_tokens` (all tokens) and `num_computed_tokens` (those
whose K/V are in the cache). The tokens still to feed are `token_ids[num_computed_tokens:]`; when the
last of them is fed, the step samples the next token. A fresh request starts at 0 computed tokens
(prefill), a decoding one has exactly one uncomputed token (the one it sampled last), and a preempted
one is reset to 0 (recompute: its generated tokens are fed again like prompt).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from blink_appliance.wire.request import FinishReason, SamplingParams, TokenLogprobs


class SequenceStatus(enum.Enum):
    WAITING = "waiting"  # queued (new, or preempted and back for recompute); holds no KV blocks
    RUNNING = "running"  # admitted; holds KV blocks for its computed tokens
    FINISHED = "finished"  # done (stop, length or abort); blocks returned


@dataclass
class Sequence:
    request_id: int
    token_ids: list[int]  # prompt, then generated tokens
    num_prompt_tokens: int
    params: SamplingParams
    priority: int  # lower runs first
    arrival: int  # admission counter: FCFS order within a priority class
    seed: int  # the request's seed, or one drawn at admission
    block_hashes: list[int] = field(default_factory=list)  # of its full prompt blocks (prefix cache)
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    num_preemptions: int = 0
    wait_since: int = 0  # the scheduler's step clock when it last entered the waiting queue (aging)
    run_priority: int = 0  # its effective priority when last admitted: its class while RUNNING
    run_order: int = 0  # admission counter: order within a class while RUNNING
    # prompt_logprobs: the next prompt position to score, and the scored ones not yet sent (they go
    # out with the first token).
    prompt_logprobs_next: int = 1
    prompt_logprobs_pending: list[TokenLogprobs] = field(default_factory=list)
    constraint_state: int = 0  # its automaton's state after its generated tokens (structured output)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def scores_prompt(self) -> bool:
        """It asked for prompt logprobs and some prompt positions are not scored yet."""
        return self.params.prompt_logprobs and self.prompt_logprobs_next < self.num_prompt_tokens

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def queue_key(self) -> tuple[int, int]:
        return (self.priority, self.arrival)

    @property
    def run_key(self) -> tuple[int, int]:
        """Running order: class, then admission; the last one is the next preemption victim."""
        return (self.run_priority, self.run_order)
