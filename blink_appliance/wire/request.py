"""What goes into an engine (requests, sampling parameters) and what comes out (token events).

These are the engine's own types; the ring layout (ring_layout.py) and the HTTP API (frontend/) translate
to and from them at their edges.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from blink_appliance.wire.automaton import TokenAutomaton

MAX_LOGPROBS = 20  # most likely tokens a request may ask for per position (OpenAI's and vLLM's limit)
MAX_LOGIT_BIAS = 300  # (token, bias) entries of one request, as OpenAI allows


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS or a stop token id (stop strings are the front end's business)
    LENGTH = "length"  # max_tokens reached, or max_model_len
    ABORT = "abort"  # cancelled by the client or by shutdown
    ERROR = "error"  # rejected or failed; TokenEvent.error says why


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int = 16
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    # Log-probabilities: None = off, else the chosen token's and the N most likely (0 <= N <= 20) per
    # generated token; prompt_logprobs adds them for prompt positions 1.. (echo).
    logprobs: int | None = None
    prompt_logprobs: bool = False
    # Penalties and biases, applied to the logits in this order before anything else (docs/engine.md,
    # "Penalties"): logit_bias; repetition over the prompt's and generated tokens; frequency and
    # presence over the generated ones.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    # Structured output: the token automaton the output follows (None: unconstrained). End of
    # sequence is allowed exactly in its accepting states (wire/automaton.py).
    constraint: TokenAutomaton | None = None

    def validate(self) -> None:
        """Raise ValueError naming the bad field."""
        if not (self.temperature >= 0.0):
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if not (0.0 <= self.min_p <= 1.0):
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.seed is not None and not (0 <= self.seed < 2**63):
            raise ValueError(f"seed must be in [0, 2**63), got {self.seed}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise ValueError(f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}")
        if self.prompt_logprobs and self.logprobs is None:
            raise ValueError("prompt_logprobs needs logprobs (how many alternatives per position)")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if not 0.0 < self.repetition_penalty <= 2.0:
            raise ValueError(f"repetition_penalty must be in (0, 2], got {self.repetition_penalty}")
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise ValueError(f"logit_bias has {len(self.logit_bias)} entries, at most {MAX_LOGIT_BIAS}")
        for token, bias in self.logit_bias:
            if not -100.0 <= bias <= 100.0:
                raise ValueError(f"logit_bias for token {token} must be in [-100, 100], got {bias}")
        if self.constraint is not None and self.ignore_eos:
            raise ValueError("a constrained output ends at its end of sequence: it cannot ignore_eos")

    @property
    def penalized(self) -> bool:
        """Its logits change before sampling (any penalty or bias)."""
        return bool(
            self.presence_penalty
            or self.frequency_penalty
            or self.repetition_penalty != 1.0
            or self.logit_bias
        )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass
class Request:
    request_id: int
    prompt_token_ids: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    priority: int = 0  # lower runs first; FCFS within a class
    # The chain hashes of its full prompt blocks (wire/prefix_hash.py), for an engine that caches
    # prefixes; () looks nothing up and caches nothing.
    block_hashes: tuple[int, ...] = ()


@dataclass(frozen=True)
class TokenLogprobs:
    """One position's log-probabilities (docs/api.md, "Logprobs"): the token's, and the N most
    likely tokens' in descending order (ties: lower id first)."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


# Slotted, not frozen: a stream makes one per token, and a frozen dataclass's __init__ (a setattr
# call per field) took about four times as long (3.1 against 0.8 us on the CPU rig).
@dataclass(slots=True)
class TokenEvent:
    """One output of an engine step for one request.

    A request yields zero or more events with a token and exactly one terminal event
    (finish_reason set). The terminal event carries the last token when there is one
    (token_id is None for aborts and errors).
    """

    request_id: int
    token_id: int | None
    finish_reason: FinishReason | None = None
    error: str | None = None
    timestamp_ns: int = 0
    logprobs: TokenLogprobs | None = None  # of token_id, when the request asked
    # Prompt positions 1..n-1, on a request's first token event when it asked (prompt_logprobs).
    prompt_logprobs: tuple[TokenLogprobs, ...] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def token_ids(self) -> list[int]:
        return [] if self.token_id is None else [self.token_id]

    @property
    def num_tokens(self) -> int:
        return int(self.token_id is not None)


@dataclass(slots=True)
class TokenRun:
    """Tokens of one request read together, none of them its last, without logprobs: what a
    response sent whole gets instead of an event per token (a batch job's thousands of tokens a
    second would otherwise cost the front end an object each)."""

    request_id: int
    token_ids: list[int]
    timestamps_ns: list[int]
    finished = False

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


OutputEvent = TokenEvent | TokenRun  # what a request's stream carries
