"""The ring areas a request may hold besides its channel: logprob rows (wire/logprob_area.py) and
its token automaton (the constraint area, docs/protocol.md), taken together at submit and given
back together when the engine is done with the channel."""

from __future__ import annotations

import numpy as np

from blink_appliance.wire.errors import EngineBusyError
from blink_appliance.wire.first_fit import FirstFit
from blink_appliance.wire.logprob_area import LogprobArea, LogprobStream
from blink_appliance.wire.region import RingRegion
from blink_appliance.wire.request import SamplingParams
from blink_appliance.wire.ring_layout import RingGeometry


class RequestAreas:
    def __init__(self, geometry: RingGeometry) -> None:
        self.logprobs = LogprobArea(geometry.logprob_pairs)
        self.constraints = FirstFit(geometry.constraint_words)

    def adopt(self, slots: set[int]) -> None:
        self.logprobs.adopt(slots)
        self.constraints.adopt(slots)

    def open(
        self, region: RingRegion, slot: int, params: SamplingParams, prompt_len: int, record: np.ndarray
    ) -> LogprobStream | None:
        """Take what the request needs for `slot`, write its automaton and point its record at both;
        EngineBusyError (holding nothing) when an area is full. Returns its logprob rows' reader."""
        stream = self.logprobs.open(region, slot, params, prompt_len)
        record[0]["lp_offset"] = stream.offset if stream else 0
        if params.constraint is not None:
            words = params.constraint.to_words()
            first = self.constraints.reserve(slot, int(words.shape[0]))
            if first is None:
                self.logprobs.release(slot)
                raise EngineBusyError("the constraint area is full (requests in flight hold all of it)")
            region.write_constraint(first, words)
            record[0]["constraint_offset"], record[0]["constraint_len"] = first, words.shape[0]
        return stream

    def release(self, slot: int) -> None:
        self.logprobs.release(slot)
        self.constraints.release(slot)
