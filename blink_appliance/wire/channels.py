"""The client's view of one output channel: the request waiting on it (Pending, whose queue its
stream reads) and the bounds the engine's words in it must keep (docs/protocol.md, "Slot
ownership" and "Words that hold what the protocol cannot produce"). EngineClient uses both."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import numpy as np

from blink_appliance.wire.logprob_area import LogprobStream
from blink_appliance.wire.region import RingRegion
from blink_appliance.wire.request import FinishReason, OutputEvent, TokenEvent, TokenRun
from blink_appliance.wire.ring_layout import FINISH_FROM_CODE, ErrorCode

# How many tokens a whole (not streamed) response's channel gathers between reads: rare enough that
# a batch of them costs the pump nothing per step, frequent enough that their text is made while
# the engine still decodes (all at the end, a batch of them finishing together would leave the
# front end one long job while the GPU waits for their successors).
HELD_TOKENS = 128
# Whole responses read in one pump pass at most: a batch of them started together comes due at the
# same step, and reading all of it at once held the event loop (and every stream) for tens of ms.
WHOLE_READS_PER_PASS = 8


@dataclass
class Pending:
    """A submitted request whose stream has not ended: the events go to its queue."""

    request_id: int
    slot: int
    generation: int
    queue: asyncio.Queue[OutputEvent] = field(default_factory=asyncio.Queue)
    runs: bool = False  # tokens go as one TokenRun per read (a whole response without logprobs)
    terminated: bool = False  # the stream already got its terminal event (maybe a local one)
    deadline_ns: int = 0  # when the request times out (0: never)
    payload_wait_since_ns: int = 0  # when a count was first seen ahead of its tokens (0: not waiting)
    logprobs: LogprobStream | None = None  # the request's rows in the logprob area, when it asked

    def deliver(self, tokens: np.ndarray, times: np.ndarray, n: int) -> None:
        """The first `n` tokens as non-final events (one TokenRun for all of them, with `runs`)."""
        if not n:
            return
        if self.runs:
            self.queue.put_nowait(TokenRun(self.request_id, tokens[:n].tolist(), times[:n].tolist()))
        elif self.logprobs is not None:
            for i, (token, stamp, lp) in enumerate(
                zip(tokens[:n].tolist(), times[:n].tolist(), self.logprobs.take(n), strict=True)
            ):
                if not self._row_holds(lp.token_id, token, i):
                    return
                prompt = self.logprobs.prompt()
                self.queue.put_nowait(TokenEvent(self.request_id, token, None, None, stamp, lp, prompt))
        else:
            # tolist() once: numpy scalar indexing per token was a visible share of a saturated front end.
            for token, stamp in zip(tokens[:n].tolist(), times[:n].tolist(), strict=True):
                self.queue.put_nowait(TokenEvent(self.request_id, token, timestamp_ns=stamp))

    def _final(self, event: TokenEvent) -> None:
        self.queue.put_nowait(event)
        self.terminated = True

    def emit_terminal(self, status: np.void, token: int | None, stamp: int) -> None:
        """The engine's terminal event, from the channel's status."""
        reason = FINISH_FROM_CODE.get(int(status["finish_reason"]), FinishReason.ERROR)
        code = int(status["error_code"])
        detail = bytes(status["error_detail"]).rstrip(b"\0").decode("utf-8", "replace")
        error = None
        if code != ErrorCode.NONE or reason is FinishReason.ERROR:
            name = ErrorCode(code).name.lower() if code in ErrorCode._value2member_map_ else f"error {code}"
            error = f"{name}: {detail}" if detail else name
        lp = prompt = None
        if self.logprobs is not None and token is not None:
            lp, prompt = self.logprobs.take(1)[0], self.logprobs.prompt()
            if not self._row_holds(lp.token_id, token, self.logprobs.taken - 1):
                return
        self._final(TokenEvent(self.request_id, token, reason, error, stamp, lp, prompt))

    def _row_holds(self, row_token: int, token: int, index: int) -> bool:
        """A token's logprob row names the token: else the engine published the token before its row
        (or wrote it elsewhere), and the stream ends with an error instead of wrong numbers (the
        client then cancels the request)."""
        if row_token == token:
            return True
        self.terminate(
            FinishReason.ERROR,
            f"engine_failure: the logprob row of output token {index} names token {row_token}, not {token}",
        )
        return False

    def terminate(self, reason: FinishReason, error: str) -> None:
        """A terminal event of the client's own (timeout, dead engine, corrupt channel), unless the
        stream already has one."""
        if not self.terminated:
            self._final(TokenEvent(self.request_id, None, reason, error, time.monotonic_ns()))


class ChannelBounds:
    """Per slot, what the engine's words may hold while the client waits on the channel: a count up
    to the request's max_tokens and never below what was read; a done word that is the claim's
    predecessor (its value at the claim, or generation - 1) until it is the generation, which comes
    only with a final count. Anything else was written by something other than the engine."""

    def __init__(self, slots: int) -> None:
        self.max_tokens = np.zeros(slots, dtype=np.uint64)
        self.claim_done = np.zeros(slots, dtype=np.uint64)
        self.faulted = np.zeros(slots, dtype=bool)  # a fault was handled; the slot waits for the engine
        self.faults = 0  # channels found so (telemetry)

    def claim(self, slot: int, done: int, max_tokens: int) -> None:
        """The client takes the slot for a request of `max_tokens`; its done word reads `done` now."""
        self.max_tokens[slot], self.claim_done[slot], self.faulted[slot] = max_tokens, done, False

    def bad_done(self, done: np.ndarray, generation: np.ndarray) -> np.ndarray:
        """Per slot: the done word is neither the claim's predecessor nor `generation - 1` (callers
        leave out the slots where it is the generation)."""
        return (done != self.claim_done) & (done != generation - np.uint64(1))

    def fault(
        self,
        slot: int,
        generation: int,
        start: int,
        count: int,
        final: bool,
        done: bool,
        bad_done: int | None,
    ) -> str | None:
        """What is wrong with the channel's words, counted; None when nothing is."""
        fault = None
        if bad_done is not None:
            fault = f"done word {bad_done} is neither generation {generation} nor the one before it"
        elif count > self.max_tokens[slot]:
            fault = f"count word {count} is past the request's max_tokens {int(self.max_tokens[slot])}"
        elif count < start:
            fault = f"count word {count} went back below the {start} tokens already read"
        elif done and not final:
            fault = f"done word {generation} came without a final count (count word {count})"
        self.faults += fault is not None
        return fault


def slots_to_read(
    tracked: np.ndarray,
    ends: np.ndarray,
    counts: np.ndarray,
    delivered: np.ndarray,
    whole: np.ndarray,
    bounds: ChannelBounds,
) -> np.ndarray:
    """The tracked slots the pump reads this pass: those with an end word (`ends`) or unread tokens,
    less the whole responses that rest (`resting`) and those past this pass's share (`spread`)."""
    unread = (counts != delivered) & ~resting(whole, delivered, counts, bounds)
    return spread(np.nonzero(tracked & (ends | unread))[0], whole, counts, delivered)


def resting(
    whole: np.ndarray, delivered: np.ndarray, counts: np.ndarray, bounds: ChannelBounds
) -> np.ndarray:
    """Per slot: a whole response, read once already, whose channel holds fewer than HELD_TOKENS
    unread tokens and keeps its bounds. The pump leaves it unread (its tokens wait in the channel),
    so a batch of whole responses costs no Python per step."""
    unread_ok = (delivered <= counts) & (counts < delivered + np.uint64(HELD_TOKENS))
    return whole & (delivered > 0) & unread_ok & (counts <= bounds.max_tokens) & ~bounds.faulted


def spread(slots: np.ndarray, whole: np.ndarray, counts: np.ndarray, delivered: np.ndarray) -> np.ndarray:
    """`slots` less the whole responses beyond the WHOLE_READS_PER_PASS with the most unread tokens:
    those wait in their channels for a later pass."""
    heavy = whole[slots]
    if np.count_nonzero(heavy) <= WHOLE_READS_PER_PASS:
        return slots
    candidates = slots[heavy]
    backlog = counts[candidates].astype(np.int64) - delivered[candidates].astype(np.int64)
    chosen = candidates[np.argpartition(-backlog, WHOLE_READS_PER_PASS)[:WHOLE_READS_PER_PASS]]
    return np.sort(np.concatenate([slots[~heavy], chosen]))


def terminal_written(region: RingRegion, slot: int) -> bool:
    """The engine wrote the channel's terminal status (the claim cleared it; the engine writes it
    only when it finishes the request): stamped, and naming a finish."""
    status = region.read_status(slot)
    return int(status["finish_ns"]) != 0 and int(status["finish_reason"]) in FINISH_FROM_CODE
