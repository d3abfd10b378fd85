"""A validated request, ready to submit: what the completion service prepares from an HTTP body and
hands to the engine, one per choice."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from blink_appliance.wire.request import SamplingParams


def effective_priority(base: int, requested: int | None) -> int:
    """The priority a request runs at: its base (the key's class, else the model's), or what it
    asks for when that is lower (a larger number): a request never raises itself above its base."""
    return base if requested is None else max(base, requested)


@dataclass
class Prepared:
    """A validated request, ready to submit."""

    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    stop_strings: list[str]
    stream: bool
    include_usage: bool
    priority: int = 0  # effective: lower runs first (effective_priority)
    completion_tokens: int = 0
    top_n: int | None = None  # logprobs: alternatives per position (None: no logprobs)
    echo: str | None = None  # the prompt's text, sent before the completion (completions' echo)
    score_only: bool = False  # max_tokens 0 with echo: the one token generated is not returned
    tool_mode: Any = None  # chat with tools: how the reply becomes a tool call (frontend/tool_calls.py)
    arrived_ns: int = 0  # when its HTTP handler began, and when it went to the engine (monotonic ns)
    submitted_ns: int = 0

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt_ids)

    def choice(self, index: int) -> Prepared:
        """Choice `index` of an n > 1 request: the same request on its own seed stream (seed + index
        when seeded, as vLLM's; else the engine draws one), counting its own tokens."""
        seed = self.params.seed
        params = replace(self.params, seed=None if seed is None else (seed + index) % 2**63)
        return replace(self, params=params, completion_tokens=0)
