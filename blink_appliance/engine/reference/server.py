"""Engine side of the rings: poll the request ring, drive an engine, publish its tokens.

The CPU reference engine runs under this loop; the GPU loop does the same work in a kernel over
the same layout (docs/protocol.md). The hot path makes no syscalls per request: it reads and
writes mapped memory and only sleeps (briefly) after a bounded spin with nothing to do.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import threading
import time
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from blink_appliance.wire.automaton import TokenAutomaton
from blink_appliance.wire.lifecycle import (
    FRONTEND_TIMEOUT_S,
    HEARTBEAT_INTERVAL_S,
    ServerLifecycle,
    Throttle,
    drain_ring,
    finish_abandoned_channels,
    release_arena,
    write_terminal,
)
from blink_appliance.wire.prefix_hash import hash_values
from blink_appliance.wire.region import RingRegion
from blink_appliance.wire.request import MAX_LOGPROBS, FinishReason, Request, SamplingParams, TokenEvent
from blink_appliance.wire.ring_layout import (
    SERVING_COUNTER_FIELDS,
    STEP_TIME_FIELDS,
    ErrorCode,
    RingGeometry,
    logprob_pair_count,
    output_logprob_row,
    step_time_bucket,
)
from blink_appliance.wire.transport import Transport

log = logging.getLogger(__name__)
# How often the loop looks for cancelled channels that nobody serves (lifecycle.finish_abandoned_channels).
ABANDONED_CHECK_S = 0.5


class ServedEngine(Protocol):
    """What EngineServer needs from an engine (LLMEngine satisfies it)."""

    def add_request(self, request: Request) -> None: ...
    def abort(self, request_id: int) -> None: ...
    def step(self) -> list[TokenEvent]: ...
    def has_unfinished(self) -> bool: ...
    def stats(self) -> object: ...


@dataclass
class _Live:
    """A request the engine holds, and where its output goes."""

    slot: int
    generation: int
    written: int = 0
    # Its rows in the logprob area, when it asked: first pair, pairs per row, row of output 0.
    logprobs: tuple[int, int, int] | None = None


class _Rejected(Exception):
    def __init__(self, code: ErrorCode, detail: str) -> None:
        super().__init__(detail)
        self.code = code
        self.detail = detail


def _engine_vocab_size(engine: object) -> int:
    for path in (("vocab_size",), ("config", "vocab_size"), ("model", "config", "vocab_size")):
        obj = engine
        for name in path:
            obj = getattr(obj, name, None)
        if isinstance(obj, int):
            return obj
    raise ValueError("EngineServer: pass vocab_size= (the engine exposes no vocab_size)")


class EngineServer:
    def __init__(
        self,
        engine: ServedEngine,
        transport: Transport,
        geometry: RingGeometry,
        *,
        vocab_size: int | None = None,
        idle_spin: int = 200,
        idle_sleep_s: float = 0.0002,
        admit_per_iteration: int = 256,
        frontend_timeout_s: float = FRONTEND_TIMEOUT_S,
        heartbeat_interval_s: float = HEARTBEAT_INTERVAL_S,
        telemetry_interval_s: float = 0.01,
    ) -> None:
        self.engine = engine
        block_size = getattr(getattr(engine, "config", None), "block_size", None)
        if geometry.prefix_block_size and block_size and geometry.prefix_block_size != block_size:
            raise ValueError(
                f"ring prefix_block_size is {geometry.prefix_block_size}: its block hashes must cover the "
                f"engine's KV blocks of {block_size} tokens"
            )
        self.region = RingRegion.attach(transport, geometry)
        self.geometry = geometry
        self.vocab_size = vocab_size if vocab_size is not None else _engine_vocab_size(engine)
        self.idle_spin = idle_spin
        self.idle_sleep_s = idle_sleep_s
        self.admit_per_iteration = admit_per_iteration
        self._lifecycle = ServerLifecycle(
            self.region,
            self._telemetry_values,
            heartbeat_interval_s=heartbeat_interval_s,
            telemetry_interval_s=telemetry_interval_s,
            frontend_timeout_s=frontend_timeout_s,
        )
        self._live: dict[int, _Live] = {}  # request id -> channel
        self._live_gen = np.zeros(geometry.max_inflight, dtype=np.uint64)  # 0: slot not live here
        self._slot_request = np.zeros(geometry.max_inflight, dtype=np.int64)
        # What this server counts itself; the engine's stats() gives the rest of the telemetry.
        self._counters = dict.fromkeys((*SERVING_COUNTER_FIELDS, *STEP_TIME_FIELDS), 0)
        self._tail = 0
        self._arena_tail = 0
        self._abandoned = Throttle(ABANDONED_CHECK_S)

    # -- the loop ---------------------------------------------------------------------------------
    def run(self, stop: threading.Event) -> None:
        """Serve until `stop` is set or the shutdown word is written; then abort what is in flight."""
        self._start()
        # A thread, not this loop, beats: a long CPU step (a big prefill) must not look like death.
        heartbeat = self._lifecycle.heartbeat
        heartbeat.start()
        try:
            idle = 0
            while not stop.is_set():
                if self.region.load("shutdown"):
                    break
                self._hold_consumer_words()
                moved = self._admit()
                if self._abandoned.due():
                    finish_abandoned_channels(self.region, self._live_gen, self._tail)
                if self._live:
                    self._apply_cancels()
                    self._reclaim_if_frontend_lost()
                if self.engine.has_unfinished():
                    t0 = time.monotonic_ns()
                    events = self.engine.step()
                    step_ns = time.monotonic_ns() - t0
                    self._counters["last_step_ns"] = step_ns
                    self._counters[STEP_TIME_FIELDS[step_time_bucket(step_ns)]] += 1
                    self._publish(events)
                    moved = True
                self._counters["loop_iterations"] += 1
                self._lifecycle.maybe_write_telemetry()
                if moved:
                    idle = 0
                else:
                    idle += 1
                    if idle > self.idle_spin:
                        time.sleep(self.idle_sleep_s)
            self._terminate_all(FinishReason.ABORT, ErrorCode.SHUTDOWN, "engine shut down")
            self._drain_ring(FinishReason.ABORT, ErrorCode.SHUTDOWN, "engine shut down")
            self._lifecycle.stopped()
        except BaseException as exc:
            log.exception("engine loop failed")
            self._terminate_all(FinishReason.ERROR, ErrorCode.ENGINE_FAILURE, f"engine failed: {exc!r}")
            self._lifecycle.failed()
            raise
        finally:
            heartbeat.stop()

    def _start(self) -> None:
        """Take over the region for a new epoch and consume the ring from where the last one stopped."""
        self._lifecycle.begin()
        self._tail, self._arena_tail = self.region.load("req_tail"), self.region.load("arena_tail")
        self._lifecycle.serving()

    # -- admission --------------------------------------------------------------------------------
    def _hold_consumer_words(self) -> None:
        """Put req_tail and arena_tail back if anything else wrote them: they are this engine's, it
        keeps the true values, and the front end sizes the ring's free space from the words."""
        r = self.region
        words = (("req_tail", self._tail), ("arena_tail", self._arena_tail))
        for name, ours in words:
            if (seen := r.load(name)) != ours:
                log.error("the region's %s word read %d, this engine's is %d: overwritten; put back",
                          name, seen, ours)  # fmt: skip
                r.store(name, ours)

    def _admit(self) -> bool:
        r = self.region
        admitted = 0
        while admitted < self.admit_per_iteration and r.record_seq(self._tail) == self._tail + 1:
            record = r.read_record(self._tail)[0]  # a private copy: validated once, no TOCTOU
            self._admit_record(record)
            self._tail += 1
            r.store("req_tail", self._tail)  # the slot may be reused only after the copy
            admitted += 1
        return admitted > 0

    def _release_arena(self, record: np.void) -> None:
        self._arena_tail = release_arena(self.region, self._arena_tail, int(record["arena_end"]))

    def _admit_record(self, record: np.void) -> None:
        slot, gen = int(record["slot"]), int(record["generation"])
        addressable = (
            slot < self.geometry.max_inflight
            and gen != 0
            and self.region.load_ctl(slot, "generation") == gen
            and self._live_gen[slot] == 0
            and self.region.load_progress(slot, "done") != gen
        )
        if not addressable:
            # No channel we may write to: count it and move on (the front end broke the protocol).
            self._release_arena(record)
            self._counters["records_unaddressable"] += 1
            log.warning("dropped request record with unusable slot %d / generation %d", slot, gen)
            return
        try:
            request = self._decode(record)
        except _Rejected as rej:
            self._release_arena(record)
            self._counters["requests_rejected"] += 1
            write_terminal(self.region, slot, gen, FinishReason.ERROR, rej.code, rej.detail)
            return
        self._release_arena(record)
        if self.region.load_ctl(slot, "cancel") == gen:
            self._counters["requests_cancelled"] += 1
            write_terminal(self.region, slot, gen, FinishReason.ABORT, ErrorCode.NONE, "")
            return
        try:
            self.engine.add_request(request)
        except ValueError as exc:
            self._counters["requests_rejected"] += 1
            write_terminal(self.region, slot, gen, FinishReason.ERROR, ErrorCode.ENGINE_REJECTED, str(exc))
            return
        p = request.params
        span = None
        if p.logprobs is not None:
            span = (
                int(record["lp_offset"]),
                1 + p.logprobs,
                output_logprob_row(0, len(request.prompt_token_ids), p.prompt_logprobs),
            )
        self._live[request.request_id] = _Live(slot, gen, logprobs=span)
        self._live_gen[slot] = gen
        self._slot_request[slot] = request.request_id
        self._counters["requests_admitted"] += 1

    def _decode(self, record: np.void) -> Request:
        """Record -> Request, or _Rejected naming the first bad field."""
        g = self.geometry
        request_id = int(record["request_id"])
        if request_id in self._live:
            raise _Rejected(ErrorCode.BAD_RECORD, f"request id {request_id} is already in flight")
        n = int(record["prompt_len"])
        if not 1 <= n <= g.max_prompt_tokens:
            raise _Rejected(ErrorCode.PROMPT_LENGTH, f"prompt_len {n} not in [1, {g.max_prompt_tokens}]")
        offset, end = int(record["prompt_offset"]), int(record["arena_end"])
        words = self.region.layout.prompt_words(n)  # its block hashes follow when the ring has them
        if (
            offset < self._arena_tail
            or end != offset + words
            or end > self.region.load("arena_head")
            or offset % g.arena_tokens + words > g.arena_tokens
        ):
            raise _Rejected(
                ErrorCode.BAD_RECORD,
                f"prompt at arena [{offset}, {end}) of length {n} is outside the published arena",
            )
        arena = self.region.read_prompt(offset, words)
        prompt, hashes = arena[:n], hash_values(arena[n:])
        bad = np.nonzero((prompt < 0) | (prompt >= self.vocab_size))[0]
        if bad.size:
            i = int(bad[0])
            raise _Rejected(
                ErrorCode.TOKEN_OUT_OF_VOCAB,
                f"prompt token {int(prompt[i])} at position {i} outside vocab of {self.vocab_size}",
            )
        n_stop = int(record["n_stop"])
        if n_stop > g.max_stop_ids:
            raise _Rejected(ErrorCode.STOP_IDS, f"n_stop {n_stop} > max_stop_ids {g.max_stop_ids}")
        stop_ids = record["stop_ids"][:n_stop]
        if np.any((stop_ids < 0) | (stop_ids >= self.vocab_size)):
            raise _Rejected(ErrorCode.STOP_IDS, f"stop token ids {stop_ids.tolist()} outside vocab")
        max_tokens = int(record["max_tokens"])
        if not 1 <= max_tokens <= g.max_output_tokens:
            raise _Rejected(
                ErrorCode.MAX_TOKENS, f"max_tokens {max_tokens} not in [1, {g.max_output_tokens}]"
            )
        flags = {name: int(record[name]) for name in ("has_seed", "ignore_eos")}
        for name, value in flags.items():
            if value not in (0, 1):
                raise _Rejected(ErrorCode.INVALID_PARAMS, f"{name} must be 0 or 1, got {value}")
        logprobs = self._decode_logprobs(record, n, max_tokens)
        n_bias = int(record["n_bias"])
        if n_bias > g.max_logit_bias:
            raise _Rejected(ErrorCode.INVALID_PARAMS, f"n_bias {n_bias} > max_logit_bias {g.max_logit_bias}")
        bias_ids = record["bias_ids"][:n_bias]
        if np.any((bias_ids < 0) | (bias_ids >= self.vocab_size)):
            raise _Rejected(
                ErrorCode.INVALID_PARAMS, f"logit_bias token ids {bias_ids.tolist()} outside vocab"
            )
        names = (
            "temperature",
            "top_p",
            "min_p",
            "presence_penalty",
            "frequency_penalty",
            "repetition_penalty",
        )
        floats = {name: float(record[name]) for name in names}
        for name, value in floats.items():
            if not math.isfinite(value):
                raise _Rejected(ErrorCode.INVALID_PARAMS, f"{name} must be finite, got {value}")
        params = SamplingParams(
            temperature=floats["temperature"],
            top_p=floats["top_p"],
            top_k=int(record["top_k"]),
            min_p=floats["min_p"],
            seed=int(record["seed"]) if flags["has_seed"] else None,
            max_tokens=max_tokens,
            stop_token_ids=tuple(int(t) for t in stop_ids),
            ignore_eos=bool(flags["ignore_eos"]),
            logprobs=logprobs,
            prompt_logprobs=bool(record["prompt_logprobs"]),
            presence_penalty=floats["presence_penalty"],
            frequency_penalty=floats["frequency_penalty"],
            repetition_penalty=floats["repetition_penalty"] or 1.0,  # 0: a record that sets none
            logit_bias=tuple(zip(bias_ids.tolist(), record["bias_values"][:n_bias].tolist(), strict=True)),
            constraint=self._decode_constraint(record),
        )
        try:
            params.validate()
        except ValueError as exc:
            raise _Rejected(ErrorCode.INVALID_PARAMS, str(exc)) from None
        return Request(
            request_id, prompt.tolist(), params, priority=int(record["priority"]), block_hashes=tuple(hashes)
        )

    def _decode_constraint(self, record: np.void) -> TokenAutomaton | None:
        """The record's token automaton, read from the constraint area and checked; None: none."""
        n, first = int(record["constraint_len"]), int(record["constraint_offset"])
        if n == 0:
            return None
        if first + n > self.geometry.constraint_words:
            raise _Rejected(
                ErrorCode.BAD_RECORD,
                f"constraint words [{first}, {first + n}) are outside the area of {self.geometry.constraint_words}",
            )
        try:
            return TokenAutomaton.from_words(self.region.read_constraint(first, n), self.vocab_size)
        except ValueError as exc:
            raise _Rejected(ErrorCode.INVALID_PARAMS, str(exc)) from None

    def _decode_logprobs(self, record: np.void, prompt_len: int, max_tokens: int) -> int | None:
        """The record's top-N count (None: no logprobs), once its rows fit the logprob area."""
        top_n, prompt = int(record["logprobs"]) - 1, int(record["prompt_logprobs"])
        if top_n == -1 and prompt == 0:
            return None
        if not 0 <= top_n <= MAX_LOGPROBS or prompt not in (0, 1):
            raise _Rejected(
                ErrorCode.INVALID_PARAMS, f"logprobs {top_n} / prompt_logprobs {prompt} out of range"
            )
        offset = int(record["lp_offset"])
        end = offset + logprob_pair_count(prompt_len, max_tokens, top_n, bool(prompt))
        if end > self.geometry.logprob_pairs:
            raise _Rejected(
                ErrorCode.BAD_RECORD,
                f"logprob rows [{offset}, {end}) are outside the area of {self.geometry.logprob_pairs} pairs",
            )
        return top_n

    # -- cancellation and reclaim -----------------------------------------------------------------
    def _apply_cancels(self) -> None:
        cancel = self.region.ctl_table()["cancel"]
        for slot in np.nonzero((self._live_gen != 0) & (cancel == self._live_gen))[0]:
            request_id = int(self._slot_request[slot])
            self.engine.abort(request_id)  # frees its sequence and KV blocks now
            self._counters["requests_cancelled"] += 1
            self._finish(request_id, FinishReason.ABORT, ErrorCode.NONE, "")

    def _reclaim_if_frontend_lost(self) -> None:
        if self._lifecycle.frontend.lost():
            log.warning("front end heartbeat stale; reclaiming %d requests", len(self._live))
            self._terminate_all(FinishReason.ABORT, ErrorCode.FRONTEND_LOST, "front end lost")
            self._drain_ring(FinishReason.ABORT, ErrorCode.FRONTEND_LOST, "front end lost")

    def _terminate_all(self, reason: FinishReason, code: ErrorCode, detail: str) -> None:
        for request_id in list(self._live):
            try:
                self.engine.abort(request_id)
            finally:
                self._finish(request_id, reason, code, detail)

    def _drain_ring(self, reason: FinishReason, code: ErrorCode, detail: str) -> None:
        """Finish every record still queued without running it."""
        self._hold_consumer_words()  # drain_ring starts from the region's words: make them ours
        drain_ring(self.region, reason, code, detail)
        self._tail, self._arena_tail = self.region.load("req_tail"), self.region.load("arena_tail")

    # -- output -----------------------------------------------------------------------------------
    def _publish(self, events: list[TokenEvent]) -> None:
        r = self.region
        cap = self.geometry.max_output_tokens
        for event in events:
            live = self._live.get(event.request_id)
            if live is None:
                continue  # already finished here (cancelled or reclaimed)
            if event.token_id is not None:
                if live.written >= cap:
                    self.engine.abort(event.request_id)
                    self._finish(event.request_id, FinishReason.LENGTH, ErrorCode.NONE, "", token=False)
                    continue
                stamp = event.timestamp_ns or time.monotonic_ns()
                if live.logprobs is not None:
                    self._write_logprobs(live, event)
                r.write_output_token(live.slot, live.written, event.token_id, stamp)
                live.written += 1
                if not event.finished:  # a terminal token is published with the final count
                    r.store_progress(live.slot, "count", live.written)
            if event.finished:
                code = (
                    ErrorCode.ENGINE_REJECTED if event.finish_reason is FinishReason.ERROR else ErrorCode.NONE
                )
                self._finish(
                    event.request_id,
                    event.finish_reason,
                    code,
                    event.error or "",
                    token=event.token_id is not None,
                    stamp=event.timestamp_ns,
                )

    def _write_logprobs(self, live: _Live, event: TokenEvent) -> None:
        """The token's row (and, with the first token, the prompt's rows), before the count covers them."""
        first, width, row0 = live.logprobs
        if event.prompt_logprobs:
            self.region.write_logprob_rows(first, event.prompt_logprobs, width)
        if event.logprobs is not None:
            self.region.write_logprob_rows(first + (row0 + live.written) * width, [event.logprobs], width)

    def _finish(
        self,
        request_id: int,
        reason: FinishReason,
        code: ErrorCode,
        detail: str,
        *,
        token: bool = False,
        stamp: int = 0,
    ) -> None:
        live = self._live.pop(request_id)
        self._live_gen[live.slot] = 0
        self._counters["requests_finished"] += 1
        write_terminal(
            self.region,
            live.slot,
            live.generation,
            reason,
            code,
            detail,
            token=token,
            stamp=stamp,
            count=live.written,
        )

    # -- telemetry --------------------------------------------------------------------------------
    def _telemetry_values(self) -> dict[str, float]:
        """The engine's stats (occupancy and step counters), then this server's own counters."""
        stats = self.engine.stats()
        values = dataclasses.asdict(stats) if dataclasses.is_dataclass(stats) else dict(vars(stats))
        values = {k: v for k, v in values.items() if isinstance(v, (int, float))}
        values.update(self._counters)
        return values
