"""The logprob area from the client's side: which requests hold which pairs of it, and reading a
request's rows back as TokenLogprobs (docs/protocol.md, "Logprob area").

The front end both takes and gives back every range, so the engine only ever sees a record's
`lp_offset`; requests finish in any order, hence first fit over a list of free ranges.
"""

from __future__ import annotations

from dataclasses import dataclass

from blink_appliance.wire.errors import EngineBusyError
from blink_appliance.wire.first_fit import FirstFit
from blink_appliance.wire.region import RingRegion
from blink_appliance.wire.request import SamplingParams, TokenLogprobs
from blink_appliance.wire.ring_layout import logprob_pair_count, output_logprob_row


class LogprobArea(FirstFit):
    """First-fit allocation of the area's pairs, one range per output channel."""

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
