"""The codes and byte offsets the loop's kernels (schedule, commit) take as constexpr arguments.

Each type names what a kernel reads; the launcher fills every field by that name from the one
definition (SlotState and COUNTER_INDEX in engine/loop/state.py, FinishReason's FINISH_CODES,
ErrorCode and the ring's structs in wire/ring_layout.py), so a renamed or missing code fails at
construction. A kernel reads them as `SLOT.RUNNING`, `RECORD.prompt_len`: compile-time constants.
"""

from __future__ import annotations

from typing import NamedTuple


class SlotStates(NamedTuple):
    """SlotState values."""

    FREE: int
    WAITING: int
    RUNNING: int
    FINISHING: int


class FinishCodes(NamedTuple):
    """The finish_reason word of each FinishReason (FINISH_CODES)."""

    STOP: int
    LENGTH: int
    ABORT: int
    ERROR: int


class ErrorCodes(NamedTuple):
    """The ErrorCode values schedule gives a record or slot it ends."""

    BAD_RECORD: int
    PROMPT_LENGTH: int
    TOKEN_OUT_OF_VOCAB: int
    STOP_IDS: int
    MAX_TOKENS: int
    INVALID_PARAMS: int
    ENGINE_REJECTED: int
    SHUTDOWN: int


class ScheduleCounters(NamedTuple):
    """COUNTER_INDEX of the counters schedule adds to."""

    loop_iterations: int
    steps: int
    preemptions: int
    requests_admitted: int
    requests_rejected: int
    requests_cancelled: int
    step_tokens: int
    records_unaddressable: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    steady_steps: int


class CommitCounters(NamedTuple):
    """COUNTER_INDEX of the counters commit writes."""

    generated_tokens: int
    requests_finished: int
    last_step_ns: int


class ControlWords(NamedTuple):
    """Byte offsets of the control words schedule reads or writes (u64 words each)."""

    req_tail: int
    arena_head: int
    arena_tail: int
    shutdown: int


class RequestFields(NamedTuple):
    """Byte offsets of a request record's fields (from the record's start)."""

    request_id: int
    generation: int
    prompt_offset: int
    arena_end: int
    seed: int
    slot: int
    priority: int
    prompt_len: int
    max_tokens: int
    temperature: int
    top_p: int
    min_p: int
    top_k: int
    has_seed: int
    ignore_eos: int
    n_stop: int
    logprobs: int
    prompt_logprobs: int
    lp_offset: int
    presence_penalty: int
    frequency_penalty: int
    repetition_penalty: int
    n_bias: int
    constraint_len: int
    constraint_offset: int
    stop_ids: int
    bias_ids: int
    bias_values: int


# The numpy type each RequestFields entry is read as (stop_ids: its elements); the launcher checks
# the ring's record against it, offsets included, since the kernel indexes words of these sizes.
REQUEST_FIELD_DTYPES: dict[str, str] = {
    "request_id": "<u8",
    "generation": "<u8",
    "prompt_offset": "<u8",
    "arena_end": "<u8",
    "seed": "<u8",
    "slot": "<u4",
    "priority": "<i4",
    "prompt_len": "<u4",
    "max_tokens": "<u4",
    "temperature": "<f8",
    "top_p": "<f8",
    "min_p": "<f8",
    "top_k": "<i4",
    "has_seed": "<u4",
    "ignore_eos": "<u4",
    "n_stop": "<u4",
    "logprobs": "<u4",
    "prompt_logprobs": "<u4",
    "lp_offset": "<u8",
    "presence_penalty": "<f8",
    "frequency_penalty": "<f8",
    "repetition_penalty": "<f8",
    "n_bias": "<u4",
    "constraint_len": "<u4",
    "constraint_offset": "<u8",
    "stop_ids": "<i4",
    "bias_ids": "<i4",
    "bias_values": "<f4",
}


class RecordAreas(NamedTuple):
    """What schedule checks a record's logprob rows and token automaton against."""

    pairs: int  # the ring's logprob_pairs
    max_top_n: int  # the most alternatives a request may ask for (wire.request.MAX_LOGPROBS)
    constraint_at: int  # byte offset of the ring's constraint area
    constraint_words: int  # its int32 words


class ChannelLayout(NamedTuple):
    """Sizes and byte offsets of a channel's three structs, fields named <struct>_<field>: control
    (the front end's claim and cancel words), progress (the words the front end polls), status (the
    terminal event). The kernels index each struct in u64 words."""

    ctl_bytes: int
    ctl_generation: int
    ctl_cancel: int
    progress_bytes: int
    progress_count: int
    progress_done: int
    status_bytes: int
    status_finish_ns: int
    status_finish_reason: int
    status_error_code: int
    status_terminal_token: int


# The numpy type of each ChannelLayout field the kernels read or write (not the *_bytes sizes).
CHANNEL_FIELD_DTYPES: dict[str, str] = {
    "ctl_generation": "<u8",
    "ctl_cancel": "<u8",
    "progress_count": "<u8",
    "progress_done": "<u8",
    "status_finish_ns": "<u8",
    "status_finish_reason": "<u4",
    "status_error_code": "<u4",
    "status_terminal_token": "<u4",
}
