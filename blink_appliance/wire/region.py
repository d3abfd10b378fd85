"""Typed access to the shared region through a Transport: the only code that turns layout offsets
into reads and writes. Both ends build on it; neither touches raw offsets."""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence

import numpy as np

from blink_appliance.wire.request import SamplingParams, TokenLogprobs
from blink_appliance.wire.ring_layout import (
    CHANNEL_CTL,
    CHANNEL_PROGRESS,
    CHANNEL_STATUS,
    CONTROL,
    LOGPROB_PAIR,
    MAGIC,
    TELEMETRY_FIELDS,
    RingGeometry,
    RingLayout,
    geometry_header,
    logprob_pair_count,
)
from blink_appliance.wire.transport import Transport


class RingRegion:
    def __init__(self, transport: Transport, geometry: RingGeometry) -> None:
        self.transport = transport
        self.geometry = geometry
        self.layout = RingLayout.of(geometry)
        if transport.size < self.layout.size:
            raise ValueError(
                f"transport region is {transport.size} bytes; geometry {geometry} needs {self.layout.size}"
            )

    # -- creation and attachment -----------------------------------------------------------------
    @classmethod
    def create(cls, transport: Transport, geometry: RingGeometry) -> RingRegion:
        """Initialise a fresh (zeroed) region for `geometry`; the magic word is written last."""
        region = cls(transport, geometry)
        region.write_header()
        return region

    @classmethod
    def attach(cls, transport: Transport, geometry: RingGeometry) -> RingRegion:
        """Map a region some creator initialised; refuse one built for another layout or geometry."""
        if transport.size < 64:
            raise ValueError(f"transport region of {transport.size} bytes is too small for a ring header")
        fault = header_fault(transport, geometry)
        if fault is not None:
            raise ValueError(
                f"shared region mismatch: {fault} "
                "(different protocol version or ring geometry on the two ends)"
            )
        return cls(transport, geometry)

    # -- the header (line 0 of the control block, the creator's) ----------------------------------
    def header_fault(self) -> str | None:
        """The first header field that no longer describes this region, or None: the daemon checks it
        while it supervises, because every process that starts later attaches through it."""
        return header_fault(self.transport, self.geometry)

    def write_header(self) -> None:
        """Write the header for this region's geometry, the magic word last (a reader that sees the
        magic sees the rest)."""
        rec = np.zeros(1, dtype=CONTROL)
        for name, value in geometry_header(self.geometry).items():
            rec[name] = value
        rec["magic"] = 0
        self.transport.write(0, rec.tobytes()[:64])
        self.transport.store_u64(CONTROL.fields["magic"][1], MAGIC)

    # -- control words ----------------------------------------------------------------------------
    def load(self, field: str) -> int:
        return self.transport.load_u64(RingLayout.control(field))

    def store(self, field: str, value: int) -> None:
        self.transport.store_u64(RingLayout.control(field), value)

    def doorbell(self, field: str, value: int) -> None:
        self.transport.doorbell(RingLayout.control(field), value)

    def load_words(self, fields: Sequence[str]) -> list[int]:
        """Several control words in one read of the span that holds them (a snapshot of each word;
        no order among them)."""
        offsets = [RingLayout.control(f) for f in fields]
        start = min(offsets)
        raw = self.transport.read(start, max(offsets) + 8 - start)
        return [int.from_bytes(raw[o - start : o - start + 8], "little") for o in offsets]

    # -- request records --------------------------------------------------------------------------
    def new_record(self) -> np.ndarray:
        return np.zeros(1, dtype=self.layout.request)

    def request_record(
        self,
        ids: tuple[int, int, int, int],
        prompt: tuple[int, int, int],
        params: SamplingParams,
        lp_offset: int = 0,
    ) -> np.ndarray:
        """A request record: ids = (request_id, generation, slot, priority), prompt = (arena offset,
        arena end, length), the sampling parameters, and where its logprob rows start (when it asks
        for logprobs); publish it with `publish_record`."""
        record = self.new_record()
        rec = record[0]
        rec["request_id"], rec["generation"], rec["slot"], rec["priority"] = ids
        rec["prompt_offset"], rec["arena_end"], rec["prompt_len"] = prompt
        rec["max_tokens"], rec["temperature"], rec["top_p"] = (
            params.max_tokens,
            params.temperature,
            params.top_p,
        )
        rec["min_p"], rec["top_k"], rec["ignore_eos"] = params.min_p, params.top_k, int(params.ignore_eos)
        rec["has_seed"], rec["seed"] = int(params.seed is not None), params.seed or 0
        rec["n_stop"] = len(params.stop_token_ids)
        rec["stop_ids"][: len(params.stop_token_ids)] = params.stop_token_ids
        rec["logprobs"] = 0 if params.logprobs is None else params.logprobs + 1
        rec["prompt_logprobs"], rec["lp_offset"] = int(params.prompt_logprobs), lp_offset
        rec["presence_penalty"], rec["frequency_penalty"] = params.presence_penalty, params.frequency_penalty
        rec["repetition_penalty"], rec["n_bias"] = params.repetition_penalty, len(params.logit_bias)
        rec["bias_ids"][: len(params.logit_bias)] = [t for t, _ in params.logit_bias]
        rec["bias_values"][: len(params.logit_bias)] = [b for _, b in params.logit_bias]
        return record

    def record_seq(self, position: int) -> int:
        return self.transport.load_u64(self.layout.record(position))

    def read_record(self, position: int) -> np.ndarray:
        raw = self.transport.read(self.layout.record(position), self.layout.request.itemsize)
        # A copy of the bytes, not of the fields: numpy's copy leaves bytes no field covers undefined.
        return np.frombuffer(bytearray(raw), dtype=self.layout.request)

    def publish_record(self, position: int, record: np.ndarray) -> None:
        """Write the payload, then the seq word (position + 1) with release semantics."""
        self.write_record(position, record)
        self.publish_seq(position)

    def write_record(self, position: int, record: np.ndarray) -> None:
        """The record's payload (everything but its seq word)."""
        self.transport.write(self.layout.record(position) + 8, record.tobytes()[8:])

    def publish_seq(self, position: int) -> None:
        """The record's seq word (position + 1): a release store, after its payload."""
        self.transport.store_u64(self.layout.record(position), position + 1)

    # -- token arena ------------------------------------------------------------------------------
    def write_prompt(self, position: int, tokens: np.ndarray) -> None:
        self.transport.write(self.layout.arena_at(position), np.ascontiguousarray(tokens, dtype="<i4"))

    def read_prompt(self, position: int, n: int) -> np.ndarray:
        return np.frombuffer(self.transport.read(self.layout.arena_at(position), 4 * n), dtype="<i4")

    # -- output channels --------------------------------------------------------------------------
    def ctl_table(self) -> np.ndarray:
        raw = self.transport.read(self.layout.chan_ctl, CHANNEL_CTL.itemsize * self.geometry.max_inflight)
        return np.frombuffer(raw, dtype=CHANNEL_CTL)

    def progress_table(self) -> np.ndarray:
        n = CHANNEL_PROGRESS.itemsize * self.geometry.max_inflight
        return np.frombuffer(self.transport.read(self.layout.chan_prog, n), dtype=CHANNEL_PROGRESS)

    def load_ctl(self, slot: int, field: str) -> int:
        return self.transport.load_u64(self.layout.ctl(slot, field))

    def store_ctl(self, slot: int, field: str, value: int) -> None:
        self.transport.store_u64(self.layout.ctl(slot, field), value)

    def load_progress(self, slot: int, field: str) -> int:
        return self.transport.load_u64(self.layout.prog(slot, field))

    def store_progress(self, slot: int, field: str, value: int) -> None:
        self.transport.store_u64(self.layout.prog(slot, field), value)

    def read_status(self, slot: int) -> np.void:
        raw = self.transport.read(self.layout.stat(slot), CHANNEL_STATUS.itemsize)
        return np.frombuffer(raw, dtype=CHANNEL_STATUS)[0]

    def write_status(
        self,
        slot: int,
        *,
        finish_ns: int,
        finish_code: int,
        error_code: int,
        terminal_token: bool,
        detail: str,
    ) -> None:
        status = np.zeros(1, dtype=CHANNEL_STATUS)
        status["finish_ns"] = finish_ns
        status["finish_reason"] = finish_code
        status["error_code"] = error_code
        status["terminal_token"] = int(terminal_token)
        status["error_detail"] = detail.encode("utf-8")[: CHANNEL_STATUS["error_detail"].itemsize]
        self.transport.write(self.layout.stat(slot), status.tobytes())

    def clear_status(self, slot: int) -> None:
        self.transport.write(self.layout.stat(slot), bytes(CHANNEL_STATUS.itemsize))

    def clear_stamps(self, slot: int, n: int) -> None:
        """Zero a channel's first `n` token stamps: an engine's stamp is never 0, so a reader can
        tell a token that has arrived from one whose count was seen first."""
        self.transport.write(self.layout.time(slot, 0), bytes(8 * n))

    def write_output_token(self, slot: int, index: int, token_id: int, time_ns: int) -> None:
        self.transport.write(self.layout.token(slot, index), int(token_id).to_bytes(4, "little", signed=True))
        self.transport.write(self.layout.time(slot, index), int(time_ns).to_bytes(8, "little"))

    def read_output(self, slot: int, start: int, stop: int) -> tuple[np.ndarray, np.ndarray]:
        return self.read_outputs([(slot, start, stop)])[0]

    def read_outputs(self, spans: Sequence[tuple[int, int, int]]) -> list[tuple[np.ndarray, np.ndarray]]:
        """Tokens and stamps [start, stop) of each (slot, start, stop), in one read_many."""
        ranges = []
        for slot, start, stop in spans:
            n = stop - start
            ranges += [(self.layout.token(slot, start), 4 * n), (self.layout.time(slot, start), 8 * n)]
        raw = self.transport.read_many(ranges)
        return [
            (np.frombuffer(raw[2 * i], dtype="<i4"), np.frombuffer(raw[2 * i + 1], dtype="<u8"))
            for i in range(len(spans))
        ]

    # -- logprob area -----------------------------------------------------------------------------
    def write_logprob_rows(self, first: int, rows: Sequence[TokenLogprobs], width: int) -> None:
        """Rows of `width` pairs from pair `first` on (the engine, before the count that covers them)."""
        pairs = np.zeros((len(rows), width), dtype=LOGPROB_PAIR)
        for i, row in enumerate(rows):
            pairs[i, 0] = (row.token_id, row.logprob)
            for j, pair in enumerate(row.top[: width - 1], 1):
                pairs[i, j] = pair
        self.transport.write(self.layout.logprob_pair(first), pairs.tobytes())

    def write_constraint(self, first: int, words: np.ndarray) -> None:
        """A token automaton's words from word `first` of the constraint area (the front end)."""
        self.transport.write(self.layout.constraint_word(first), np.ascontiguousarray(words, dtype="<i4"))

    def read_constraint(self, first: int, n: int) -> np.ndarray:
        return np.frombuffer(self.transport.read(self.layout.constraint_word(first), 4 * n), dtype="<i4")

    def read_logprob_pairs(self, first: int, n: int) -> np.ndarray:
        raw = self.transport.read(self.layout.logprob_pair(first), LOGPROB_PAIR.itemsize * n)
        return np.frombuffer(raw, dtype=LOGPROB_PAIR)

    # -- telemetry (seqlock: odd while the engine writes) ------------------------------------------
    def write_telemetry(self, values: Mapping[str, float]) -> None:
        # Start from an even word: a writer that died mid-write (a recovered engine) left it odd,
        # and counting on from there would mark every later block as "being written". Wrapped below
        # 2**64 - 2 so that a word overwritten near 2**64 cannot overflow the two stores below.
        seq = ((self.load("telemetry_seq") + 1) & ~1) % (2**64 - 2)
        self.store("telemetry_seq", seq + 1)
        block = np.array([int(values.get(name, 0)) for name in TELEMETRY_FIELDS], dtype="<u8")
        self.transport.write(RingLayout.control("t_" + TELEMETRY_FIELDS[0]), block)
        self.store("telemetry_seq", seq + 2)

    def read_telemetry(self, timeout_s: float = 1.0) -> dict[str, int]:
        """One consistent telemetry block. A retry sleeps (0, then up to 1 ms) rather than spins:
        on a small host the writer can be descheduled mid-write, and only yielding lets it finish."""
        start = RingLayout.control("t_" + TELEMETRY_FIELDS[0])
        deadline = time.monotonic() + timeout_s
        pause = 0.0
        while True:
            before = self.load("telemetry_seq")
            if not before & 1:
                block = np.frombuffer(self.transport.read(start, 8 * len(TELEMETRY_FIELDS)), dtype="<u8")
                if self.load("telemetry_seq") == before:
                    return {name: int(v) for name, v in zip(TELEMETRY_FIELDS, block, strict=True)}
            if time.monotonic() >= deadline:
                raise TimeoutError(
                    f"telemetry block still being written after {timeout_s:g} s (sequence word {before})"
                )
            time.sleep(pause)
            pause = min(max(2 * pause, 1e-5), 1e-3)


def header_fault(transport: Transport, geometry: RingGeometry) -> str | None:
    """Which header field of the region behind `transport` does not match `geometry`, and how."""
    have = np.frombuffer(transport.read(0, 64).ljust(CONTROL.itemsize, b"\0"), dtype=CONTROL)[0]
    for name, want in geometry_header(geometry).items():
        if int(have[name]) != want:
            return f"header field {name} is {int(have[name])}, expected {want}"
    return None


def checked_submission(
    prompt_token_ids: list[int], params: SamplingParams, priority: int, geometry: RingGeometry
) -> np.ndarray:
    """The prompt as int64 ids, once the request fits the ring's limits; ValueError naming what does not."""
    g = geometry
    params.validate()
    prompt = np.asarray(prompt_token_ids, dtype=np.int64)
    if prompt.ndim != 1 or not 1 <= prompt.size <= g.max_prompt_tokens:
        raise ValueError(f"prompt must hold 1 to {g.max_prompt_tokens} token ids, got {prompt.size}")
    if prompt.min() < 0 or prompt.max() >= 2**31:
        raise ValueError("prompt token ids must be in [0, 2**31)")
    if params.max_tokens > g.max_output_tokens:
        raise ValueError(f"max_tokens {params.max_tokens} exceeds this server's limit {g.max_output_tokens}")
    if len(params.stop_token_ids) > g.max_stop_ids:
        raise ValueError(f"at most {g.max_stop_ids} stop token ids, got {len(params.stop_token_ids)}")
    if len(params.logit_bias) > g.max_logit_bias:
        raise ValueError(f"at most {g.max_logit_bias} logit_bias entries, got {len(params.logit_bias)}")
    if any(not 0 <= t < 2**31 for t, _ in params.logit_bias):
        raise ValueError("logit_bias token ids must be in [0, 2**31)")
    if any(not 0 <= t < 2**31 for t in params.stop_token_ids):
        raise ValueError("stop token ids must be in [0, 2**31)")
    if not -(2**31) <= priority < 2**31:
        raise ValueError(f"priority must fit in int32, got {priority}")
    if params.logprobs is not None:
        pairs = logprob_pair_count(prompt.size, params.max_tokens, params.logprobs, params.prompt_logprobs)
        if pairs > g.logprob_pairs:
            raise ValueError(
                f"logprobs for this request need {pairs} (token, logprob) pairs; this server's logprob "
                f"area holds {g.logprob_pairs}" + (" (logprobs are off)" if not g.logprob_pairs else "")
            )
    return prompt
