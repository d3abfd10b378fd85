"""The logprob area from the client's side: which requests hold which pairs of it, and reading a
request's rows back as TokenLogprobs (docs/protocol.md, "Logprob area").

The front end both takes and gives back every range, so the engine only ever sees a record's
`lp_offset`; requests finish in any order, hence first fit over a list of free ranges.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

from blink_appliance.wire.errors import EngineBusyError
from blink_appliance.wire.region import RingRegion
from blink_appliance.wire.request import SamplingParams, TokenLogprobs
from blink_appliance.wire.ring_layout import logprob_pair_count, output_logprob_row


class LogprobArea:
    """First-fit allocation of the area's pairs, one range per output channel."""

    def __init__(self, pairs: int) -> None:
        self.pairs = pairs
        self._free: list[tuple[int, int]] = [(0, pairs)] if pairs else []  # sorted, disjoint [start, end)
        self._held: dict[int, tuple[int, int]] = {}  # slot -> its range
        # Channels a previous front end left in flight: where their rows are is not known, so
        # nothing is handed out until the engine has finished all of them.
        self._unknown: set[int] = set()

    def adopt(self, slots: set[int]) -> None:
        self._unknown = set(slots)

    def reserve(self, slot: int, n: int) -> int | None:
        """The first pair of `n` free ones, now held by `slot`; None when no range is large enough."""
        if self._unknown:
            return None
        for i, (start, end) in enumerate(self._free):
            if end - start >= n:
                if end - start == n:
                    del self._free[i]
                else:
                    self._free[i] = (start + n, end)
                self._held[slot] = (start, start + n)
                return start
        return None

    def open(
        self, region: RingRegion, slot: int, params: SamplingParams, prompt_len: int
    ) -> LogprobStream | None:
        """The rows of a request that asks for logprobs, now held by `slot` (None: it does not ask);
        EngineBusyError when no free range is large enough."""
        if params.logprobs is None:
            return None
        n = logprob_pair_count(prompt_len, params.max_tokens, params.logprobs, params.prompt_logprobs)
        offset = self.reserve(slot, n)
        if offset is None:
            raise EngineBusyError("the logprob area is full (requests in flight hold all of it)")
        return LogprobStream(region, offset, params.logprobs, prompt_len, params.prompt_logprobs)

    def release(self, slot: int) -> None:
        """The engine is done with `slot`: its range (if any) is free again, merged with its neighbours."""
        self._unknown.discard(slot)
        held = self._held.pop(slot, None)
        if held is None:
            return
        start, end = held
        i = bisect.bisect(self._free, held)
        if i < len(self._free) and self._free[i][0] == end:
            end = self._free.pop(i)[1]
        if i > 0 and self._free[i - 1][1] == start:
            start = self._free.pop(i - 1)[0]
            i -= 1
        self._free.insert(i, (start, end))

    @property
    def free_pairs(self) -> int:
        return sum(end - start for start, end in self._free)


@dataclass
class LogprobStream:
    """Reads one request's rows in output order, as its tokens are delivered."""

    region: RingRegion
    offset: int  # the request's first pair
    top_n: int
    prompt_len: int
    with_prompt: bool
    taken: int = 0  # output rows read so far
    prompt_sent: bool = False

    @property
    def width(self) -> int:
        return 1 + self.top_n

    def take(self, n: int) -> list[TokenLogprobs]:
        """The next `n` output tokens' rows (published: the caller read a count that covers them)."""
        row = output_logprob_row(self.taken, self.prompt_len, self.with_prompt)
        self.taken += n
        return self._rows(row, n)

    def prompt(self) -> tuple[TokenLogprobs, ...] | None:
        """Prompt positions 1..prompt_len-1, once (with the first token), when the request asked."""
        if not self.with_prompt or self.prompt_sent:
            return None
        self.prompt_sent = True
        return tuple(self._rows(0, self.prompt_len - 1))

    def _rows(self, first_row: int, n: int) -> list[TokenLogprobs]:
        if n <= 0:
            return []
        w = self.width
        pairs = self.region.read_logprob_pairs(self.offset + first_row * w, n * w).reshape(n, w)
        tokens, logprobs = pairs["token"].tolist(), pairs["logprob"].tolist()
        return [
            TokenLogprobs(t[0], lp[0], tuple(zip(t[1:], lp[1:], strict=True)))
            for t, lp in zip(tokens, logprobs, strict=True)
        ]
