"""The one binary layout of the shared region: request ring, token arena, output channels, control words.

Both ends (front end, engine) and later the GPU kernels read and write exactly these bytes, so
everything is fixed-size, little-endian, naturally aligned, and every word that another party polls
is a u64 at an 8-byte aligned offset. docs/protocol.md describes the protocol on top of it.

Region, in order (each section starts on a 64-byte boundary):
  control    CONTROL dtype (header + counters + heartbeats + telemetry), 1 record
  records    REQUEST record [request_slots]
  arena      int32 [arena_tokens]                    prompt tokens (+ block hashes), a ring of its own
  chan_ctl   CHANNEL_CTL [max_inflight]              written by the front end
  chan_prog  CHANNEL_PROGRESS [max_inflight]         written by the engine (count, done)
  chan_stat  CHANNEL_STATUS [max_inflight]           written by the engine (finish, error)
  tokens     int32 [max_inflight, max_output_tokens] written by the engine
  times      int64 [max_inflight, max_output_tokens] written by the engine (monotonic ns)
  logprobs   LOGPROB_PAIR [logprob_pairs]            written by the engine where a record points
  constraints int32 [constraint_words]               token automata, written by the front end
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import numpy as np

from blink_appliance.wire.prefix_hash import prompt_words
from blink_appliance.wire.request import FinishReason

MAGIC = int.from_bytes(b"BLINKRNG", "little")
# 2: the step-time histogram in the telemetry block; 3: its bounds reach 16.8 s; 4: the logprob area,
# penalties and logit_bias in the records; 5: block hashes after each prompt in the arena (prefix cache);
# 6: the constraint area (structured output) and the records' constraint fields
VERSION = 6
CACHE_LINE = 64
# Top bit of a channel's `count` word: the terminal status is written and `count` is final. It is
# set in the same store that publishes the terminal token, so a reader never mistakes the last
# token for an ordinary one.
FINAL_BIT = 1 << 63
ERROR_DETAIL_BYTES = 104


@dataclass(frozen=True)
class RingGeometry:
    """Fixed capacities of the region; the profile fills it and both ends must agree on it."""

    request_slots: int = 256  # records in the request ring
    arena_tokens: int = 1 << 20  # prompt tokens the arena holds at once
    max_prompt_tokens: int = 32768  # one request's prompt
    max_inflight: int = 256  # requests submitted and not yet fully read by the front end
    max_output_tokens: int = 4096  # one request's output tokens
    max_stop_ids: int = 16  # stop token ids per request
    # (token, logprob) pairs of the logprob area, shared by the requests in flight that ask for
    # logprobs (docs/protocol.md, "Logprob area"); 0: no area, logprobs are refused.
    logprob_pairs: int = 1 << 20
    max_logit_bias: int = 300  # (token, bias) entries per request record
    # The engine's KV block size when it caches prefixes: each prompt is followed in the arena by the
    # hashes of its full blocks of this size (wire/prefix_hash.py); 0: no hashes.
    prefix_block_size: int = 0
    # int32 words of the constraint area: the token automata of the structured-output requests in
    # flight (wire/automaton.py; docs/protocol.md, "Constraint area"); 0: no area, constraints refused.
    constraint_words: int = 1 << 22

    def __post_init__(self) -> None:
        for name in (
            "request_slots",
            "arena_tokens",
            "max_prompt_tokens",
            "max_inflight",
            "max_output_tokens",
            "max_stop_ids",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1 or value >= 2**31:
                raise ValueError(f"RingGeometry.{name} must be an int in [1, 2**31), got {value!r}")
        if not isinstance(self.prefix_block_size, int) or not 0 <= self.prefix_block_size <= 1024:
            raise ValueError(
                f"RingGeometry.prefix_block_size must be an int in [0, 1024], got {self.prefix_block_size!r}"
            )
        words = prompt_words(self.max_prompt_tokens, self.prefix_block_size)
        if words > self.arena_tokens:
            raise ValueError(
                f"RingGeometry.arena_tokens ({self.arena_tokens}) must hold one prompt of max_prompt_tokens "
                f"({self.max_prompt_tokens}) and its block hashes ({words} words)"
            )
        if not isinstance(self.constraint_words, int) or not 0 <= self.constraint_words < 2**31:
            raise ValueError(
                f"RingGeometry.constraint_words must be an int in [0, 2**31), got {self.constraint_words!r}"
            )
        if not isinstance(self.logprob_pairs, int) or not 0 <= self.logprob_pairs < 2**31:
            raise ValueError(
                f"RingGeometry.logprob_pairs must be an int in [0, 2**31), got {self.logprob_pairs!r}"
            )
        if not isinstance(self.max_logit_bias, int) or not 0 <= self.max_logit_bias <= 65536:
            raise ValueError(
                f"RingGeometry.max_logit_bias must be an int in [0, 65536], got {self.max_logit_bias!r}"
            )


class EngineState(enum.IntEnum):
    """engine_state word."""

    ABSENT = 0  # no engine has attached yet
    STARTING = 1  # attached, recovering channels of a previous epoch
    RUNNING = 2
    STOPPED = 3  # exited cleanly (shutdown or stop event)
    FAILED = 4  # the engine raised; in-flight requests were failed


class ErrorCode(enum.IntEnum):
    """chan_stat.error_code; NONE for normal finishes and client cancels."""

    NONE = 0
    BAD_RECORD = 1  # slot/generation/arena fields inconsistent
    PROMPT_LENGTH = 2
    TOKEN_OUT_OF_VOCAB = 3
    STOP_IDS = 4
    MAX_TOKENS = 5
    INVALID_PARAMS = 6  # temperature/top_p/top_k/min_p/seed out of range
    ENGINE_REJECTED = 7  # engine.add_request raised ValueError
    ENGINE_FAILURE = 8  # engine.step raised
    ENGINE_RESTARTED = 9  # admitted by an engine epoch that died
    FRONTEND_LOST = 10  # the front end's heartbeat went stale; request reclaimed
    SHUTDOWN = 11  # engine shut down with the request in flight


# finish_reason word <-> FinishReason; 0 means "not finished".
FINISH_CODES: dict[FinishReason, int] = {
    FinishReason.STOP: 1,
    FinishReason.LENGTH: 2,
    FinishReason.ABORT: 3,
    FinishReason.ERROR: 4,
}
FINISH_FROM_CODE: dict[int, FinishReason] = {v: k for k, v in FINISH_CODES.items()}

# Engine step time histogram: steps (iterations that ran a forward) whose time was at most each
# bound, in microseconds, the last bucket unbounded; counts per bucket, not cumulative. Doubling from
# 32 us (a small GPU step) to 16.8 s: a CPU reference step takes tens to hundreds of ms, and seconds
# on a host loaded by other work (4-5 s seen on a 2-core host at load 9), and each lands in a bucket.
STEP_TIME_BOUNDS_US: tuple[int, ...] = (
    32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768,
    65536, 131072, 262144, 524288, 1048576, 2097152, 4194304, 8388608, 16777216,
)  # fmt: skip
STEP_TIME_FIELDS: tuple[str, ...] = tuple(f"step_time_hist_{i}" for i in range(len(STEP_TIME_BOUNDS_US) + 1))


def step_time_bucket(step_ns: int) -> int:
    """The histogram bucket of one step's time: the first bound (us) it does not exceed."""
    return next(
        (i for i, b in enumerate(STEP_TIME_BOUNDS_US) if step_ns <= b * 1000), len(STEP_TIME_BOUNDS_US)
    )


# The telemetry block the engine publishes (u64 each, under a seqlock), by group. Names match
# EngineStats where they come from it.
# Occupancy now (gauges): from the engine's scheduler on the reference engine, slot states on the loop.
# kv_blocks_cached: blocks no sequence holds that keep a cached prefix (free, evicted last).
OCCUPANCY_FIELDS: tuple[str, ...] = (
    "running",
    "waiting",
    "kv_blocks_used",
    "kv_blocks_total",
    "kv_blocks_cached",
)
# Counters of the engine's steps: EngineStats on the reference engine. The prefix cache's are in
# tokens: those admissions looked up, and those they found cached.
STEP_COUNTER_FIELDS: tuple[str, ...] = (
    "steps",
    "generated_tokens",
    "preemptions",
    "prefix_cache_queries",
    "prefix_cache_hits",
)
# Counters of the serving loop around the steps: the reference engine's ring server keeps them.
SERVING_COUNTER_FIELDS: tuple[str, ...] = (
    "requests_admitted",
    "requests_rejected",
    "requests_finished",
    "requests_cancelled",
    "records_unaddressable",  # records with no channel the engine may answer on (counted, skipped)
    "loop_iterations",
    "last_step_ns",  # not cumulative: the latest step's time
)
# Every counter an engine publishes; the GPU loop keeps them all on the device (engine/loop/state.py).
ENGINE_COUNTER_FIELDS: tuple[str, ...] = (*STEP_COUNTER_FIELDS, *SERVING_COUNTER_FIELDS)
TELEMETRY_FIELDS: tuple[str, ...] = (
    *OCCUPANCY_FIELDS,
    *ENGINE_COUNTER_FIELDS,
    "updated_ns",
    *STEP_TIME_FIELDS,
)


def _round_up(n: int, to: int) -> int:
    return (n + to - 1) // to * to


def _struct(fields: list[tuple[str, str, int]], itemsize: int) -> np.dtype:
    """A structured dtype with explicit offsets; checks natural alignment of each field."""
    names, formats, offsets = [], [], []
    for name, fmt, offset in fields:
        base = np.dtype(fmt).base
        if offset % base.alignment:
            raise AssertionError(f"field {name} at {offset} is not {base.alignment}-aligned")
        names.append(name)
        formats.append(fmt)
        offsets.append(offset)
    dtype = np.dtype({"names": names, "formats": formats, "offsets": offsets, "itemsize": itemsize})
    return dtype


def _control_dtype() -> np.dtype:
    fields: list[tuple[str, str, int]] = [
        # line 0: identity (written once by the region's creator)
        ("magic", "<u8", 0),
        ("version", "<u4", 8),
        ("control_bytes", "<u4", 12),
        ("region_bytes", "<u8", 16),
        ("request_slots", "<u4", 24),
        ("arena_tokens", "<u4", 28),
        ("max_prompt_tokens", "<u4", 32),
        ("max_inflight", "<u4", 36),
        ("max_output_tokens", "<u4", 40),
        ("max_stop_ids", "<u4", 44),
        ("logprob_pairs", "<u4", 48),
        ("max_logit_bias", "<u4", 52),
        ("prefix_block_size", "<u4", 56),
        ("constraint_words", "<u4", 60),
        # line 1: front end's producer words
        ("req_head", "<u8", 64),  # records published so far
        ("arena_head", "<u8", 72),  # arena tokens allocated so far (absolute)
        ("next_request_id", "<u8", 80),
        # line 2: engine's consumer words
        ("req_tail", "<u8", 128),  # records consumed so far
        ("arena_tail", "<u8", 136),  # arena tokens released so far (absolute)
        # line 3: engine liveness
        ("engine_heartbeat_ns", "<u8", 192),
        ("engine_epoch", "<u8", 200),
        ("engine_state", "<u8", 208),
        ("engine_pid", "<u8", 216),
        # line 4: front end liveness
        ("frontend_heartbeat_ns", "<u8", 256),
        ("frontend_epoch", "<u8", 264),
        ("frontend_pid", "<u8", 272),
        # line 5: shutdown request (daemon or front end writes 1)
        ("shutdown", "<u8", 320),
        # lines 6+: telemetry seqlock + counters
        ("telemetry_seq", "<u8", 384),
    ]
    for i, name in enumerate(TELEMETRY_FIELDS):
        fields.append((f"t_{name}", "<u8", 392 + 8 * i))
    end = 392 + 8 * len(TELEMETRY_FIELDS)
    return _struct(fields, _round_up(end, CACHE_LINE))


def _request_dtype(geometry: RingGeometry) -> np.dtype:
    stop_bytes, bias = 4 * geometry.max_stop_ids, geometry.max_logit_bias
    fields = [
        ("seq", "<u8", 0),  # position in the ring + 1; written LAST, 0 = empty
        ("request_id", "<u8", 8),
        ("generation", "<u8", 16),  # the channel's generation this request owns
        ("prompt_offset", "<u8", 24),  # absolute arena position of token 0
        ("arena_end", "<u8", 32),  # arena_head after this record's tokens (what the engine releases to)
        ("seed", "<u8", 40),
        ("slot", "<u4", 48),  # output channel index
        ("priority", "<i4", 52),
        ("prompt_len", "<u4", 56),
        ("max_tokens", "<u4", 60),
        # f64 so the engine sees exactly the client's Python floats (kernels may narrow them)
        ("temperature", "<f8", 64),
        ("top_p", "<f8", 72),
        ("min_p", "<f8", 80),
        ("top_k", "<i4", 88),
        ("has_seed", "<u4", 92),
        ("ignore_eos", "<u4", 96),
        ("n_stop", "<u4", 100),
        ("logprobs", "<u4", 104),  # 0: none; N + 1 for N alternatives (a zeroed record asks for none)
        ("prompt_logprobs", "<u4", 108),  # 1: prompt positions 1.. get rows too
        ("lp_offset", "<u8", 112),  # first pair of the request's rows in the logprob area
        ("presence_penalty", "<f8", 120),
        ("frequency_penalty", "<f8", 128),
        ("repetition_penalty", "<f8", 136),  # 0 reads as 1 (off), so a zeroed record asks for none
        ("n_bias", "<u4", 144),  # logit_bias entries used
        ("constraint_len", "<u4", 148),  # words of its token automaton; 0: unconstrained
        ("constraint_offset", "<u8", 152),  # its first word in the constraint area
        # No hole between fields: a copy of the record need not copy bytes no field covers.
        ("stop_ids", ("<i4", (geometry.max_stop_ids,)), 160),
        ("bias_ids", ("<i4", (bias,)), 160 + stop_bytes),
        ("bias_values", ("<f4", (bias,)), 160 + stop_bytes + 4 * bias),
    ]
    return _struct(fields, _round_up(160 + stop_bytes + 8 * bias, CACHE_LINE))


CHANNEL_CTL = _struct(
    [
        ("generation", "<u8", 0),  # bumped by the front end when it claims the slot
        ("cancel", "<u8", 8),  # = generation to cancel; a stale value never matches a later one
        ("request_id", "<u8", 16),
    ],
    32,
)
CHANNEL_PROGRESS = _struct(
    [
        ("count", "<u8", 0),  # tokens published (| FINAL_BIT at the end); written after the tokens
        ("done", "<u8", 8),  # = generation once the terminal status is written; written last
    ],
    16,
)
CHANNEL_STATUS = _struct(
    [
        ("finish_ns", "<u8", 0),  # engine time of the terminal event
        ("finish_reason", "<u4", 8),  # FINISH_CODES; 0 = not finished
        ("error_code", "<u4", 12),  # ErrorCode
        ("terminal_token", "<u4", 16),  # 1: the last published token is the terminal event's token
        ("error_detail", f"S{ERROR_DETAIL_BYTES}", 24),  # utf-8, NUL padded
    ],
    24 + ERROR_DETAIL_BYTES,
)
CONTROL = _control_dtype()
# One entry of a logprob row: a row is 1 + N pairs, the position's own token then the N most likely.
LOGPROB_PAIR = _struct([("token", "<i4", 0), ("logprob", "<f4", 4)], 8)


def logprob_pair_count(prompt_len: int, max_tokens: int, top_n: int, prompt_logprobs: bool) -> int:
    """Pairs a request's logprobs take: a row of 1 + top_n for each prompt position 1..prompt_len-1
    when asked, then one for each output token."""
    return (max_tokens + (prompt_len - 1 if prompt_logprobs else 0)) * (1 + top_n)


def output_logprob_row(index: int, prompt_len: int, prompt_logprobs: bool) -> int:
    """The row of output token `index` (prompt position p, when asked, is row p - 1)."""
    return index + (prompt_len - 1 if prompt_logprobs else 0)


@dataclass(frozen=True)
class RingLayout:
    """Byte offsets of every section for one geometry."""

    geometry: RingGeometry
    request: np.dtype
    records: int
    arena: int
    chan_ctl: int
    chan_prog: int
    chan_stat: int
    tokens: int
    times: int
    logprobs: int
    constraints: int
    size: int

    @classmethod
    def of(cls, geometry: RingGeometry) -> RingLayout:
        g = geometry
        request = _request_dtype(g)
        sections = [
            ("records", request.itemsize * g.request_slots),
            ("arena", 4 * g.arena_tokens),
            ("chan_ctl", CHANNEL_CTL.itemsize * g.max_inflight),
            ("chan_prog", CHANNEL_PROGRESS.itemsize * g.max_inflight),
            ("chan_stat", CHANNEL_STATUS.itemsize * g.max_inflight),
            ("tokens", 4 * g.max_inflight * g.max_output_tokens),
            ("times", 8 * g.max_inflight * g.max_output_tokens),
            ("logprobs", LOGPROB_PAIR.itemsize * g.logprob_pairs),
            ("constraints", 4 * g.constraint_words),
        ]
        offsets: dict[str, int] = {}
        at = _round_up(CONTROL.itemsize, CACHE_LINE)
        for name, nbytes in sections:
            offsets[name] = at
            at = _round_up(at + nbytes, CACHE_LINE)
        return cls(geometry=g, request=request, size=at, **offsets)

    # -- offsets of single items --------------------------------------------------------------
    @staticmethod
    def control(field: str) -> int:
        return CONTROL.fields[field][1]

    def record(self, index: int) -> int:
        return self.records + self.request.itemsize * (index % self.geometry.request_slots)

    def prompt_words(self, prompt_len: int) -> int:
        """Arena words of one prompt: its tokens, then its block hashes when the ring carries them."""
        return prompt_words(prompt_len, self.geometry.prefix_block_size)

    def arena_at(self, position: int) -> int:
        return self.arena + 4 * (position % self.geometry.arena_tokens)

    def ctl(self, slot: int, field: str) -> int:
        return self.chan_ctl + CHANNEL_CTL.itemsize * slot + CHANNEL_CTL.fields[field][1]

    def prog(self, slot: int, field: str) -> int:
        return self.chan_prog + CHANNEL_PROGRESS.itemsize * slot + CHANNEL_PROGRESS.fields[field][1]

    def stat(self, slot: int) -> int:
        return self.chan_stat + CHANNEL_STATUS.itemsize * slot

    def token(self, slot: int, index: int) -> int:
        return self.tokens + 4 * (slot * self.geometry.max_output_tokens + index)

    def time(self, slot: int, index: int) -> int:
        return self.times + 8 * (slot * self.geometry.max_output_tokens + index)

    def logprob_pair(self, index: int) -> int:
        return self.logprobs + LOGPROB_PAIR.itemsize * index

    def constraint_word(self, index: int) -> int:
        return self.constraints + 4 * index


def region_size(geometry: RingGeometry) -> int:
    return RingLayout.of(geometry).size


def geometry_header(geometry: RingGeometry) -> dict[str, int]:
    """The header words that identify a region built for `geometry`."""
    layout = RingLayout.of(geometry)
    return {
        "magic": MAGIC,
        "version": VERSION,
        "control_bytes": CONTROL.itemsize,
        "request_slots": geometry.request_slots,
        "arena_tokens": geometry.arena_tokens,
        "max_prompt_tokens": geometry.max_prompt_tokens,
        "max_inflight": geometry.max_inflight,
        "max_output_tokens": geometry.max_output_tokens,
        "max_stop_ids": geometry.max_stop_ids,
        "logprob_pairs": geometry.logprob_pairs,
        "max_logit_bias": geometry.max_logit_bias,
        "prefix_block_size": geometry.prefix_block_size,
        "constraint_words": geometry.constraint_words,
        "region_bytes": layout.size,  # last: a geometry mismatch is reported by its field first
    }
