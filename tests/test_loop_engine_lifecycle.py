"""The GPU loop's ring server (engine/loop/server.py): its life cycle.

Life-cycle paths (epoch and recovery, RUNNING, heartbeat, telemetry from the loop's counters, stop by
event or by the ring's word, queued records drained, failure) run here with stand-ins for the token
path that do only what the kernels do at those edges: end the loop once the shutdown word is set,
take a record, raise. The served path itself (the real LoopStep under the Triton interpreter, greedy
tokens equal to the CPU reference engine) is in tests/test_loop_engine_server.py.
"""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # the loop's kernels run on the CPU under the interpreter

from blink_appliance.engine.loop.server import LoopEngineServer, LoopSnapshot, telemetry_values
from blink_appliance.engine.loop.state import COUNTER_INDEX, DeviceState, LoopGeometry, SlotState
from blink_appliance.wire.region import RingRegion
from blink_appliance.wire.request import FinishReason
from blink_appliance.wire.ring_layout import FINISH_CODES, STEP_TIME_FIELDS, EngineState, ErrorCode
from tests.ring_support import SMALL, RawProducer, serve_in_thread, shm_region, wait_until

GEOMETRY = LoopGeometry(
    num_slots=4,
    max_num_seqs=2,
    max_num_batched_tokens=8,
    buckets=(8,),
    block_size=4,
    num_kv_blocks=16,
    max_model_len=32,
    max_stop_ids=SMALL.max_stop_ids,
    vocab_size=512,
    eos_token_ids=(2,),
)


def _state() -> DeviceState:
    return DeviceState.allocate(GEOMETRY, "cpu")


def _take_record(region: RingRegion) -> None:
    """What schedule does when it admits a record: consume it and release its prompt."""
    tail = region.load("req_tail")
    record = region.read_record(tail)[0]
    region.store("arena_tail", int(record["arena_end"]))
    region.store("req_tail", tail + 1)


def _status(region: RingRegion, slot: int) -> tuple[FinishReason, ErrorCode]:
    status = region.read_status(slot)
    reason = {v: k for k, v in FINISH_CODES.items()}[int(status["finish_reason"])]
    return reason, ErrorCode(int(status["error_code"]))


def _check_failed_with_held(
    region: RingRegion,
    server: LoopEngineServer,
    errors: list[BaseException],
    held: tuple[int, int],
    raised: str,
) -> None:
    """The run raised `raised` once, the region is FAILED, and the request the loop held (slot,
    generation) was failed with engine_failure."""
    assert len(errors) == 1 and raised in str(errors[0])
    assert region.load("engine_state") == EngineState.FAILED
    assert region.load_progress(held[0], "done") == held[1]
    assert _status(region, held[0]) == (FinishReason.ERROR, ErrorCode.ENGINE_FAILURE)
    assert server.report.failed_requests == 1


class EndsOnShutdown:
    """host_step stand-in: the loop's reaction to the ring's shutdown word (keep_running = 0)."""

    def __init__(self, region: RingRegion, state: DeviceState, fail_after: int | None = None) -> None:
        self.region, self.state, self.fail_after = region, state, fail_after
        self.calls = 0

    def __call__(self) -> None:
        self.calls += 1
        if self.fail_after is not None and self.calls > self.fail_after:
            raise RuntimeError("kernel exploded")
        if self.region.load("shutdown"):
            self.state.keep_running.fill_(0)


class ThreadLoop:
    """DeviceLoop stand-in: 'runs' from launch until it sees the shutdown word (or fails)."""

    def __init__(self, region: RingRegion, state: DeviceState) -> None:
        self.region, self.state = region, state
        self.error: str | None = None
        self.launched = self.closed = False
        self._thread = threading.Thread(target=self._body, daemon=True)

    def _body(self) -> None:
        while not self.region.load("shutdown") and self.error is None:
            time.sleep(0.001)
        self.state.keep_running.fill_(0)

    def launch(self) -> None:
        self.launched = True
        self._thread.start()

    def running(self) -> bool:
        if self.error is not None:
            raise RuntimeError(self.error)
        return self._thread.is_alive()

    def join(self, timeout_s: float | None = None) -> bool:
        self._thread.join(timeout_s)
        return not self._thread.is_alive()

    def close(self) -> None:
        self.closed = True


# -- pieces ---------------------------------------------------------------------------------------
def test_telemetry_values_from_a_loop_snapshot():
    counters = [0] * len(COUNTER_INDEX)
    counters[COUNTER_INDEX["generated_tokens"]] = 77
    counters[COUNTER_INDEX["steps"]] = 9
    counters[COUNTER_INDEX["requests_cancelled"]] = 2
    counters[COUNTER_INDEX["last_step_ns"]] = 1_500_000
    slots = [SlotState.RUNNING, SlotState.WAITING, SlotState.RUNNING, SlotState.FREE]
    step_times = list(range(len(STEP_TIME_FIELDS)))
    values = telemetry_values(counters, slots, free_top=10, num_kv_blocks=16, step_times=step_times, cached=4)
    assert (values["running"], values["waiting"]) == (2, 1)
    assert (values["kv_blocks_used"], values["kv_blocks_total"], values["kv_blocks_cached"]) == (2, 16, 4)
    assert (values["generated_tokens"], values["steps"], values["requests_cancelled"]) == (77, 9, 2)
    assert "step_tokens" not in values  # a loop counter the ring's telemetry has no word for
    assert values["last_step_ns"] == 1_500_000
    assert [values[f] for f in STEP_TIME_FIELDS] == step_times


def test_snapshot_copies_counters_slots_and_free_top():
    state = _state()
    state.counters[COUNTER_INDEX["loop_iterations"]] = 5
    state.slot_state[1] = SlotState.WAITING
    state.free_top.fill_(3)
    state.step_time_hist[2] = 7
    state.lru_words[2] = 2
    snap = LoopSnapshot(state)
    counters, slots, free_top, step_times, cached = snap.read()
    assert counters[COUNTER_INDEX["loop_iterations"]] == 5 and slots[1] == SlotState.WAITING and free_top == 3
    assert step_times[2] == 7 and sum(step_times) == 7 and cached == 2
    state.free_top.fill_(4)
    assert snap.read()[2] == 4  # a fresh copy each time


def test_modes_need_their_token_path():
    with shm_region() as transport:
        region = RingRegion.attach(transport, SMALL)
        with pytest.raises(ValueError, match="mode 'loop' needs the built DeviceLoop"):
            LoopEngineServer(region, _state(), GEOMETRY, mode="loop")
        with pytest.raises(ValueError, match="mode 'host' needs host_step"):
            LoopEngineServer(region, _state(), GEOMETRY, mode="host")


# -- life cycle, mode "host" -------------------------------------------------------------------------
def test_host_mode_takes_the_region_publishes_telemetry_and_stops_on_the_stop_event():
    with shm_region() as transport:
        region = RingRegion.attach(transport, SMALL)
        producer = RawProducer(region)
        orphan = producer.publish([5, 6])  # taken by an engine epoch that died
        _take_record(region)
        state = _state()
        state.counters[COUNTER_INDEX["generated_tokens"]] = 42
        state.slot_state[0] = SlotState.RUNNING
        state.free_top.fill_(GEOMETRY.num_kv_blocks - 3)
        server = LoopEngineServer(
            region,
            state,
            GEOMETRY,
            mode="host",
            host_step=EndsOnShutdown(region, state),
            clock_offset_ns=lambda: 12345,
            heartbeat_interval_s=0.01,
            telemetry_interval_s=0.01,
        )
        stop = threading.Event()
        thread, errors = serve_in_thread(server, stop)
        wait_until(lambda: region.load("engine_state") == EngineState.RUNNING, "server did not start")
        assert region.load("engine_epoch") == 1
        assert region.load_progress(orphan[0], "done") == orphan[1]
        assert _status(region, orphan[0]) == (FinishReason.ERROR, ErrorCode.ENGINE_RESTARTED)
        assert int(state.clock_offset_ns[0]) == 12345
        telemetry = region.read_telemetry()
        assert telemetry["generated_tokens"] == 42 and telemetry["running"] == 1
        assert (telemetry["kv_blocks_used"], telemetry["kv_blocks_total"]) == (3, GEOMETRY.num_kv_blocks)
        beat = region.load("engine_heartbeat_ns")
        wait_until(lambda: region.load("engine_heartbeat_ns") != beat, "heartbeat did not advance")
        state.counters[COUNTER_INDEX["generated_tokens"]] = 50
        wait_until(lambda: region.read_telemetry()["generated_tokens"] == 50, "telemetry did not refresh")

        queued = producer.publish([7, 8, 9])  # the stand-in never admits it
        stop.set()
        t0 = time.monotonic()
        thread.join(5)
        assert not thread.is_alive() and not errors, errors
        assert time.monotonic() - t0 < 1.0
        assert region.load("engine_state") == EngineState.STOPPED
        assert region.load_progress(queued[0], "done") == queued[1]
        assert _status(region, queued[0]) == (FinishReason.ABORT, ErrorCode.SHUTDOWN)
        assert (server.report.drained_records, server.report.left_open) == (1, 0)
        assert region.load("req_tail") == region.load("req_head")
        assert region.load("shutdown") == 0  # its own request withdrawn: a next epoch may serve


def test_a_shutdown_word_from_the_daemon_stops_it_and_stays():
    with shm_region() as transport:
        region = RingRegion.attach(transport, SMALL)
        state = _state()
        server = LoopEngineServer(
            region, state, GEOMETRY, mode="host", host_step=EndsOnShutdown(region, state)
        )
        thread, errors = serve_in_thread(server, threading.Event())
        wait_until(lambda: region.load("engine_state") == EngineState.RUNNING, "server did not start")
        region.store("shutdown", 1)
        thread.join(5)
        assert not thread.is_alive() and not errors
        assert region.load("engine_state") == EngineState.STOPPED and region.load("shutdown") == 1


def test_host_mode_failure_marks_failed_and_fails_what_the_loop_held():
    with shm_region() as transport:
        region = RingRegion.attach(transport, SMALL)
        producer = RawProducer(region)
        held, queued = producer.publish([1, 2]), producer.publish([3])
        calls = []

        def admit_one_then_fail() -> None:
            calls.append(1)
            if len(calls) == 1:
                _take_record(region)  # schedule admitted `held` into a slot
                return
            raise RuntimeError("kernel exploded")

        server = LoopEngineServer(region, _state(), GEOMETRY, mode="host", host_step=admit_one_then_fail)
        thread, errors = serve_in_thread(server, threading.Event())
        thread.join(5)
        _check_failed_with_held(region, server, errors, held, "kernel exploded")
        assert region.load_progress(queued[0], "done") != queued[1]  # queued: the next epoch serves it
        assert region.load("req_tail") == 1


def test_a_loop_that_ends_without_shutdown_is_a_failure():
    with shm_region() as transport:
        region = RingRegion.attach(transport, SMALL)
        state = _state()

        def ends_by_itself() -> None:
            state.keep_running.fill_(0)

        held = RawProducer(region).publish([1])
        server = LoopEngineServer(region, state, GEOMETRY, mode="host", host_step=ends_by_itself)
        thread, errors = serve_in_thread(server, threading.Event())
        thread.join(5)
        assert len(errors) == 1 and "without a shutdown request" in str(errors[0])
        assert region.load("engine_state") == EngineState.FAILED
        assert region.load_progress(held[0], "done") != held[1]  # still queued: the next epoch serves it


# -- life cycle, mode "loop" --------------------------------------------------------------------------
def _loop_mode_server(
    region: RingRegion, **options: float
) -> tuple[LoopEngineServer, DeviceState, ThreadLoop]:
    """A server in mode "loop" over a fresh state, with ThreadLoop standing in for the device loop."""
    state = _state()
    loop = ThreadLoop(region, state)
    return LoopEngineServer(region, state, GEOMETRY, mode="loop", device_loop=loop, **options), state, loop


def test_loop_mode_launches_once_watches_and_stops_through_the_ring():
    with shm_region() as transport:
        region = RingRegion.attach(transport, SMALL)
        server, state, loop = _loop_mode_server(region, heartbeat_interval_s=0.01)
        stop = threading.Event()
        thread, errors = serve_in_thread(server, stop)
        wait_until(lambda: region.load("engine_state") == EngineState.RUNNING, "server did not start")
        assert loop.launched
        beat = region.load("engine_heartbeat_ns")
        wait_until(lambda: region.load("engine_heartbeat_ns") != beat, "heartbeat did not advance")
        stop.set()
        wait_until(lambda: not thread.is_alive(), "server did not stop", timeout=10.0)
        assert not errors, errors
        assert int(state.keep_running[0]) == 0  # the loop saw the word the server wrote
        assert region.load("engine_state") == EngineState.STOPPED
        assert region.load("shutdown") == 0


def test_loop_mode_failure_of_the_loop_marks_failed_and_fails_held_requests():
    with shm_region() as transport:
        region = RingRegion.attach(transport, SMALL)
        server, _, loop = _loop_mode_server(region)
        thread, errors = serve_in_thread(server, threading.Event())
        wait_until(lambda: region.load("engine_state") == EngineState.RUNNING, "server did not start")
        held = RawProducer(region).publish([1, 2])
        _take_record(region)
        loop.error = "CUDA error: an illegal memory access was encountered"
        thread.join(5)
        _check_failed_with_held(region, server, errors, held, "illegal memory access")


def test_a_lost_front_end_gets_its_requests_cancelled_through_the_ring():
    with shm_region() as transport:
        region = RingRegion.attach(transport, SMALL)
        server, _, _ = _loop_mode_server(region, frontend_timeout_s=0.05, heartbeat_interval_s=0.01)
        producer = RawProducer(region)
        slots = [producer.publish([4]) for _ in range(3)]
        stop = threading.Event()
        thread, errors = serve_in_thread(server, stop)
        wait_until(
            lambda: all(region.load_ctl(slot, "cancel") == gen for slot, gen in slots),
            "the stale front end's requests were not cancelled",
        )
        stop.set()
        thread.join(5)
        assert not errors, errors
