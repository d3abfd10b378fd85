"""The helpers every ring engine shares (wire/lifecycle.py): epochs, recovery, terminals, drain,
the engine's own shutdown request, heartbeat, the servers' common life cycle. Over a real
shared-memory region."""

from __future__ import annotations

import os
import time

from blink_appliance.wire.lifecycle import (
    ENGINE_SHUTDOWN_REQUEST,
    FrontendWatch,
    Heartbeat,
    ServerLifecycle,
    Throttle,
    begin_epoch,
    drain_ring,
    finish_open_channels,
    queued_channels,
    request_shutdown,
    withdraw_shutdown_request,
    write_terminal,
)
from blink_appliance.wire.region import RingRegion
from blink_appliance.wire.request import FinishReason
from blink_appliance.wire.ring_layout import FINAL_BIT, FINISH_CODES, EngineState, ErrorCode
from tests.ring_support import SMALL, RawProducer, shm_region


def _region(transport) -> RingRegion:
    return RingRegion.attach(transport, SMALL)


def _consume(region: RingRegion, n: int) -> None:
    """Take `n` records the way an engine does (tail and arena released)."""
    tail = region.load("req_tail")
    for position in range(tail, tail + n):
        record = region.read_record(position)[0]
        region.store("arena_tail", int(record["arena_end"]))
    region.store("req_tail", tail + n)


def test_begin_epoch_counts_up_and_marks_starting():
    with shm_region() as transport:
        r = _region(transport)
        assert begin_epoch(r) == 1 and begin_epoch(r) == 2
        assert r.load("engine_state") == EngineState.STARTING
        assert r.load("engine_pid") == os.getpid()


def test_write_terminal_publishes_status_then_final_count_then_done():
    with shm_region() as transport:
        r = _region(transport)
        slot, gen = RawProducer(r).publish([1, 2, 3])
        r.store_progress(slot, "count", 5)
        write_terminal(r, slot, gen, FinishReason.ERROR, ErrorCode.ENGINE_FAILURE, "boom", stamp=123)
        assert r.load_progress(slot, "count") == 5 | FINAL_BIT  # the tokens already published stay
        assert r.load_progress(slot, "done") == gen
        status = r.read_status(slot)
        assert int(status["finish_ns"]) == 123
        assert int(status["finish_reason"]) == FINISH_CODES[FinishReason.ERROR]
        assert int(status["error_code"]) == ErrorCode.ENGINE_FAILURE
        assert bytes(status["error_detail"]).rstrip(b"\0") == b"boom"
        write_terminal(r, slot, gen, FinishReason.STOP, ErrorCode.NONE, "", token=True, count=7)
        assert r.load_progress(slot, "count") == 7 | FINAL_BIT and int(r.read_status(slot)["terminal_token"])


def test_open_channels_are_finished_unless_their_record_is_still_queued():
    with shm_region() as transport:
        r = _region(transport)
        producer = RawProducer(r)
        finished_before = producer.publish([8])
        taken = [producer.publish([5, 6]) for _ in range(3)]
        _consume(r, 4)  # an engine took these four, finished the first and died
        write_terminal(r, *finished_before, FinishReason.STOP, ErrorCode.NONE, "")
        queued = [producer.publish([7]) for _ in range(2)]  # these it never read
        assert queued_channels(r) >= set(queued)
        slots = finish_open_channels(r, FinishReason.ERROR, ErrorCode.ENGINE_RESTARTED, "engine restarted")
        assert sorted(slots) == sorted(slot for slot, _ in taken)
        for slot, gen in taken:
            assert r.load_progress(slot, "done") == gen
            assert int(r.read_status(slot)["error_code"]) == ErrorCode.ENGINE_RESTARTED
        for slot, gen in queued:
            assert r.load_progress(slot, "done") != gen  # served by the next reader of the ring
        assert r.read_status(finished_before[0])["error_code"] == ErrorCode.NONE  # not finished twice


def test_drain_ring_finishes_every_queued_record_and_releases_the_arena():
    with shm_region() as transport:
        r = _region(transport)
        producer = RawProducer(r)
        good = [producer.publish([1] * n) for n in (3, 4)]
        producer.publish([9], overrides={"slot": SMALL.max_inflight + 3})  # no channel to finish
        assert drain_ring(r, FinishReason.ABORT, ErrorCode.SHUTDOWN, "engine shut down") == 3
        assert r.load("req_tail") == r.load("req_head") == 3
        assert r.load("arena_tail") == r.load("arena_head") == 8
        for slot, gen in good:
            assert r.load_progress(slot, "done") == gen
            status = r.read_status(slot)
            assert int(status["finish_reason"]) == FINISH_CODES[FinishReason.ABORT]
            assert int(status["error_code"]) == ErrorCode.SHUTDOWN
        assert drain_ring(r, FinishReason.ABORT, ErrorCode.SHUTDOWN, "") == 0


def test_an_engine_withdraws_only_its_own_shutdown_request():
    with shm_region() as transport:
        r = _region(transport)
        request_shutdown(r)
        assert r.load("shutdown") == ENGINE_SHUTDOWN_REQUEST
        withdraw_shutdown_request(r)
        assert r.load("shutdown") == 0
        r.store("shutdown", 1)  # the daemon's
        request_shutdown(r)
        withdraw_shutdown_request(r)
        assert r.load("shutdown") == 1


def test_heartbeat_advances_until_stopped():
    with shm_region() as transport:
        r = _region(transport)
        beat = Heartbeat(r, interval_s=0.01)
        beat.start()
        first = r.load("engine_heartbeat_ns")
        deadline = time.monotonic() + 5
        while r.load("engine_heartbeat_ns") == first:
            assert time.monotonic() < deadline, "heartbeat did not advance"
            time.sleep(0.005)
        beat.stop()
        last = r.load("engine_heartbeat_ns")
        time.sleep(0.05)
        assert r.load("engine_heartbeat_ns") == last
        beat.start()  # a server that runs again beats again
        deadline = time.monotonic() + 5
        while r.load("engine_heartbeat_ns") == last:
            assert time.monotonic() < deadline, "restarted heartbeat did not advance"
            time.sleep(0.005)
        beat.stop()


def test_server_lifecycle_takes_the_region_marks_its_states_and_throttles_telemetry():
    with shm_region() as transport:
        r = _region(transport)
        producer = RawProducer(r)
        orphan = producer.publish([5, 6])
        _consume(r, 1)  # taken by an engine epoch that died
        queued = producer.publish([7])
        values = {"generated_tokens": 7}
        lifecycle = ServerLifecycle(
            r,
            lambda: dict(values),
            heartbeat_interval_s=0.01,
            telemetry_interval_s=3600.0,
            frontend_timeout_s=5.0,
        )
        lifecycle.begin()
        assert r.load("engine_epoch") == 1 and r.load("engine_state") == EngineState.STARTING
        assert r.load_progress(orphan[0], "done") == orphan[1]
        assert int(r.read_status(orphan[0])["error_code"]) == ErrorCode.ENGINE_RESTARTED
        assert r.load_progress(queued[0], "done") != queued[1]  # the new epoch serves it
        assert r.load("engine_heartbeat_ns") > 0
        telemetry = r.read_telemetry()
        assert telemetry["generated_tokens"] == 7 and telemetry["updated_ns"] > 0
        lifecycle.serving()
        assert r.load("engine_state") == EngineState.RUNNING
        values["generated_tokens"] = 8
        lifecycle.maybe_write_telemetry()  # due: the first call
        assert r.read_telemetry()["generated_tokens"] == 8
        values["generated_tokens"] = 9
        lifecycle.maybe_write_telemetry()  # not due again within the hour
        assert r.read_telemetry()["generated_tokens"] == 8
        lifecycle.stopped()  # the last telemetry, whatever the throttle says
        assert r.read_telemetry()["generated_tokens"] == 9
        assert r.load("engine_state") == EngineState.STOPPED
        lifecycle.failed()
        assert r.load("engine_state") == EngineState.FAILED


def test_frontend_watch_reports_a_still_word_once_a_timeout_and_a_moving_one_never():
    with shm_region() as transport:
        region = _region(transport)
        region.store("frontend_heartbeat_ns", 5)
        watch = FrontendWatch(region, timeout_s=0.2)
        watch.restart()
        assert not watch.lost()  # a whole timeout from restart()
        for beat in range(6, 10):  # a front end that keeps beating is never lost, however slowly
            time.sleep(0.1)
            region.store("frontend_heartbeat_ns", beat)
            assert not watch.lost()
        time.sleep(0.25)
        assert watch.lost()
        assert not watch.lost()  # reported once, then counted again from the report
        time.sleep(0.25)
        assert watch.lost()


def test_throttle_is_due_first_then_once_per_interval():
    hourly, always = Throttle(3600.0), Throttle(0.0)
    assert hourly.due() and not hourly.due() and not hourly.due()
    assert always.due() and always.due()
    brief = Throttle(0.05)
    assert brief.due()
    time.sleep(0.06)
    assert brief.due()
