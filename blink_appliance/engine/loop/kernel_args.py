"""What the loop's Triton kernels are passed besides tensors: the codes and byte offsets they take
as constexprs, read from their one definition by the names kernels/loop_codes.py declares, and the
check that a launch names each kernel parameter once.

A kernel cannot import the project (kernels/ sits below it), so DeviceScheduler and DeviceCommit
pass these in. Every field is looked up by name: a code renamed or removed on either side fails here,
at construction, and a ring field whose type or alignment differs from how a kernel reads it too.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import numpy as np

from blink_appliance.engine.loop.state import COUNTER_INDEX, SlotState
from blink_appliance.kernels.loop_codes import (
    CHANNEL_FIELD_DTYPES,
    REQUEST_FIELD_DTYPES,
    ChannelLayout,
    CommitCounters,
    ControlWords,
    ErrorCodes,
    FinishCodes,
    RecordAreas,
    RequestFields,
    ScheduleCounters,
    SlotStates,
)
from blink_appliance.wire.request import MAX_LOGPROBS, FinishReason
from blink_appliance.wire.ring_layout import (
    CHANNEL_CTL,
    CHANNEL_PROGRESS,
    CHANNEL_STATUS,
    CONTROL,
    FINISH_CODES,
    ErrorCode,
    RingLayout,
)

Codes = TypeVar("Codes", bound=tuple)


def _by_name(codes: type[Codes], lookup: Callable[[str], int]) -> Codes:
    return codes(**{name: int(lookup(name)) for name in codes._fields})


def _check_word(what: str, dtype: np.dtype, offset: int, expected: str) -> None:
    """A ring field a kernel reads or writes as words of `expected` (its elements, for an array)."""
    base = dtype.subdtype[0] if dtype.subdtype else dtype
    if base != np.dtype(expected) or offset % base.itemsize:
        raise ValueError(
            f"{what} is {dtype.str} at byte {offset}; the loop kernels access it as aligned {expected} words"
        )


SLOT_STATES = _by_name(SlotStates, lambda name: SlotState[name])
FINISH_REASONS = _by_name(FinishCodes, lambda name: FINISH_CODES[FinishReason[name]])
ERROR_CODES = _by_name(ErrorCodes, lambda name: ErrorCode[name])
SCHEDULE_COUNTERS = _by_name(ScheduleCounters, COUNTER_INDEX.__getitem__)
COMMIT_COUNTERS = _by_name(CommitCounters, COUNTER_INDEX.__getitem__)


def _control_words() -> ControlWords:
    for name in ControlWords._fields:  # schedule reads and release-stores them as u64 words
        _check_word(f"control word {name}", *CONTROL.fields[name][:2], "<u8")
    return _by_name(ControlWords, RingLayout.control)


def _channel_layout() -> ChannelLayout:
    """ChannelLayout's fields are <struct>_<field> (or <struct>_bytes) of the channel's structs."""
    structs = {"ctl": CHANNEL_CTL, "progress": CHANNEL_PROGRESS, "status": CHANNEL_STATUS}
    values: dict[str, int] = {}
    for name in ChannelLayout._fields:
        struct_name, _, field = name.partition("_")
        struct = structs[struct_name]
        if field == "bytes":
            if struct.itemsize % 8:
                raise ValueError(f"channel {struct_name} is {struct.itemsize} bytes, not whole u64 words")
            values[name] = struct.itemsize
        else:
            dtype, offset = struct.fields[field][:2]
            _check_word(f"channel {struct_name}.{field}", dtype, offset, CHANNEL_FIELD_DTYPES[name])
            values[name] = offset
    return ChannelLayout(**values)


CONTROL_WORDS = _control_words()
CHANNEL_LAYOUT = _channel_layout()


def request_fields(layout: RingLayout) -> RequestFields:
    """Byte offsets of the record fields schedule reads, checked against the types it reads them as
    (kernels/loop_codes.py REQUEST_FIELD_DTYPES)."""
    fields = layout.request.fields
    for name in RequestFields._fields:
        if name not in fields:
            raise ValueError(
                f"the ring's request record has no field {name} (kernels/schedule_records.py reads it)"
            )
        _check_word(f"request record field {name}", *fields[name][:2], REQUEST_FIELD_DTYPES[name])
    return _by_name(RequestFields, lambda name: fields[name][1])


def record_areas(layout: RingLayout) -> RecordAreas:
    g = layout.geometry
    return RecordAreas(
        pairs=g.logprob_pairs, max_top_n=MAX_LOGPROBS, constraint_at=layout.constraints,
        constraint_words=g.constraint_words,
    )  # fmt: skip


def check_parameters(kernel: Any, args: Mapping[str, object], constexprs: Mapping[str, object]) -> None:
    """Each parameter of the Triton `kernel` gets exactly one value, by name. Triton refuses a missing
    one, but an unknown name only when it compiles (its interpreter takes it for a launch option), so
    the launchers check here, once, where they build the arguments."""
    given = [*args, *constexprs]
    missing = sorted(set(kernel.arg_names) - set(given))
    unknown = sorted(set(given) - set(kernel.arg_names))
    twice = sorted(set(args) & set(constexprs))
    if missing or unknown or twice:
        raise TypeError(
            f"{kernel.__name__}: parameters without a value {missing}, names it does not take {unknown}, "
            f"given twice {twice}"
        )
