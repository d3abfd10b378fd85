"""The GPU loop's ring server (engine/loop_engine_server.py).

Life-cycle paths (epoch and recovery, RUNNING, heartbeat, telemetry from the loop's counters, stop by
event or by the ring's word, queued records drained, failure) run here with stand-ins for the token
path that do only what the kernels do at those edges: end the loop once the shutdown word is set,
take a record, raise. The served path itself (the real LoopStep under the Triton interpreter, greedy
tokens equal to the CPU reference engine) is tested further down.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import os
import threading
import time

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # the loop's kernels run on the CPU under the interpreter

from blink_appliance.engine.device_state import COUNTER_INDEX, DeviceState, LoopGeometry, SlotState
from blink_appliance.engine.loop_engine_server import LoopEngineServer, LoopSnapshot, telemetry_values
from blink_appliance.engine.request import FinishReason
from blink_appliance.transport.region import RingRegion
from blink_appliance.transport.ring_layout import FINISH_CODES, STEP_TIME_FIELDS, EngineState, ErrorCode
from tests.test_ring_support import SMALL, RawProducer, shm_region

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


@contextlib.contextmanager
def shm_region_named(name: str, geometry):
    from blink_appliance.transport.ring_layout import region_size
    from blink_appliance.transport.shm_transport import ShmTransport

    transport = ShmTransport.create(name, region_size(geometry))
    try:
        RingRegion.create(transport, geometry)
        yield transport
    finally:
        transport.close()


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


def _serve(server: LoopEngineServer, stop: threading.Event) -> tuple[threading.Thread, list[BaseException]]:
    errors: list[BaseException] = []

    def run() -> None:
        try:
            server.run(stop)
        except BaseException as exc:  # surfaced by the test
            errors.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, errors


def _wait(predicate, what: str, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.002)


# -- pieces ---------------------------------------------------------------------------------------
def test_telemetry_values_from_a_loop_snapshot():
    counters = [0] * len(COUNTER_INDEX)
    counters[COUNTER_INDEX["generated_tokens"]] = 77
    counters[COUNTER_INDEX["steps"]] = 9
    counters[COUNTER_INDEX["requests_cancelled"]] = 2
    counters[COUNTER_INDEX["last_step_ns"]] = 1_500_000
    slots = [SlotState.RUNNING, SlotState.WAITING, SlotState.RUNNING, SlotState.FREE]
    step_times = list(range(len(STEP_TIME_FIELDS)))
    values = telemetry_values(counters, slots, free_top=10, num_kv_blocks=16, step_times=step_times)
    assert (values["running"], values["waiting"]) == (2, 1)
    assert (values["kv_blocks_used"], values["kv_blocks_total"]) == (6, 16)
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
    snap = LoopSnapshot(state)
    counters, slots, free_top, step_times = snap.read()
    assert counters[COUNTER_INDEX["loop_iterations"]] == 5 and slots[1] == SlotState.WAITING and free_top == 3
    assert step_times[2] == 7 and sum(step_times) == 7
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
        thread, errors = _serve(server, stop)
        _wait(lambda: region.load("engine_state") == EngineState.RUNNING, "server did not start")
        assert region.load("engine_epoch") == 1
        assert region.load_progress(orphan[0], "done") == orphan[1]
        assert _status(region, orphan[0]) == (FinishReason.ERROR, ErrorCode.ENGINE_RESTARTED)
        assert int(state.clock_offset_ns[0]) == 12345
        telemetry = region.read_telemetry()
        assert telemetry["generated_tokens"] == 42 and telemetry["running"] == 1
        assert (telemetry["kv_blocks_used"], telemetry["kv_blocks_total"]) == (3, GEOMETRY.num_kv_blocks)
        beat = region.load("engine_heartbeat_ns")
        _wait(lambda: region.load("engine_heartbeat_ns") != beat, "heartbeat did not advance")
        state.counters[COUNTER_INDEX["generated_tokens"]] = 50
        _wait(lambda: region.read_telemetry()["generated_tokens"] == 50, "telemetry did not refresh")

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
        thread, errors = _serve(server, threading.Event())
        _wait(lambda: region.load("engine_state") == EngineState.RUNNING, "server did not start")
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
        thread, errors = _serve(server, threading.Event())
        thread.join(5)
        assert len(errors) == 1 and "kernel exploded" in str(errors[0])
        assert region.load("engine_state") == EngineState.FAILED
        assert region.load_progress(held[0], "done") == held[1]
        assert _status(region, held[0]) == (FinishReason.ERROR, ErrorCode.ENGINE_FAILURE)
        assert server.report.failed_requests == 1
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
        thread, errors = _serve(server, threading.Event())
        thread.join(5)
        assert len(errors) == 1 and "without a shutdown request" in str(errors[0])
        assert region.load("engine_state") == EngineState.FAILED
        assert region.load_progress(held[0], "done") != held[1]  # still queued: the next epoch serves it


# -- life cycle, mode "loop" --------------------------------------------------------------------------
def test_loop_mode_launches_once_watches_and_stops_through_the_ring():
    with shm_region() as transport:
        region = RingRegion.attach(transport, SMALL)
        state = _state()
        loop = ThreadLoop(region, state)
        server = LoopEngineServer(
            region, state, GEOMETRY, mode="loop", device_loop=loop, heartbeat_interval_s=0.01
        )
        stop = threading.Event()
        thread, errors = _serve(server, stop)
        _wait(lambda: region.load("engine_state") == EngineState.RUNNING, "server did not start")
        assert loop.launched
        beat = region.load("engine_heartbeat_ns")
        _wait(lambda: region.load("engine_heartbeat_ns") != beat, "heartbeat did not advance")
        stop.set()
        _wait(lambda: not thread.is_alive(), "server did not stop", timeout=10.0)
        assert not errors, errors
        assert int(state.keep_running[0]) == 0  # the loop saw the word the server wrote
        assert region.load("engine_state") == EngineState.STOPPED
        assert region.load("shutdown") == 0


def test_loop_mode_failure_of_the_loop_marks_failed_and_fails_held_requests():
    with shm_region() as transport:
        region = RingRegion.attach(transport, SMALL)
        state = _state()
        loop = ThreadLoop(region, state)
        server = LoopEngineServer(region, state, GEOMETRY, mode="loop", device_loop=loop)
        thread, errors = _serve(server, threading.Event())
        _wait(lambda: region.load("engine_state") == EngineState.RUNNING, "server did not start")
        held = RawProducer(region).publish([1, 2])
        _take_record(region)
        loop.error = "CUDA error: an illegal memory access was encountered"
        thread.join(5)
        assert len(errors) == 1 and "illegal memory access" in str(errors[0])
        assert region.load("engine_state") == EngineState.FAILED
        assert region.load_progress(held[0], "done") == held[1]
        assert _status(region, held[0]) == (FinishReason.ERROR, ErrorCode.ENGINE_FAILURE)
        assert server.report.failed_requests == 1


def test_a_lost_front_end_gets_its_requests_cancelled_through_the_ring():
    with shm_region() as transport:
        region = RingRegion.attach(transport, SMALL)
        state = _state()
        loop = ThreadLoop(region, state)
        server = LoopEngineServer(
            region, state, GEOMETRY, mode="loop", device_loop=loop, frontend_timeout_s=0.05,
            heartbeat_interval_s=0.01,
        )  # fmt: skip
        producer = RawProducer(region)
        slots = [producer.publish([4]) for _ in range(3)]
        stop = threading.Event()
        thread, errors = _serve(server, stop)
        _wait(
            lambda: all(region.load_ctl(slot, "cancel") == gen for slot, gen in slots),
            "the stale front end's requests were not cancelled",
        )
        stop.set()
        thread.join(5)
        assert not errors, errors


# -- the served path: the real loop (LoopStep) in mode "host" under the Triton interpreter -----------
def _tiny_profile(device: str = "cpu", max_model_len: int = 64, max_output_tokens: int = 24, **engine):
    from blink_appliance.profile import parse_profile

    return parse_profile(
        {
            "appliance": {"shm_name": "unused"},
            "models": [
                {
                    "name": "tiny", "source": "dummy:tiny", "dtype": "float32", "device": device,
                    "max_seqs": 2, "max_model_len": max_model_len, "max_num_batched_tokens": 16,
                    "block_size": 4, "kv_budget_gib": 0.001, "max_output_tokens": max_output_tokens,
                }
            ],
            "engine": {"mode": "host", **engine},
            "frontend": {"max_inflight": 8},
        }
    )  # fmt: skip


@contextlib.contextmanager
def served_tiny_loop(device: str = "cpu", profile_limits: dict | None = None, **engine):
    """The tiny model behind the loop (default: mode "host") on a fresh region, run in a thread.

    On a GPU everything comes from build_loop_server. On the CPU the loop's schedule, sample and
    commit kernels run under the interpreter around the reference model's forward (LoopStep.assemble
    with tests/test_loop_step.py's ReferenceStepForward): the interpreted Triton forward takes seconds
    a step, and build_loop_server's CPU path is covered by the engine-process test below.
    """
    from blink_appliance.engine.loop_engine_server import build_loop_server
    from blink_appliance.engine.loop_step import LoopStep
    from blink_appliance.model.loaders import load_checkpoint
    from blink_appliance.profile import loop_geometry, resolve_plan, ring_geometry
    from blink_appliance.transport.ring_layout import RingLayout
    from tests.test_loop_step import ReferenceStepForward

    profile = _tiny_profile(device, **(profile_limits or {}), **engine)
    ckpt = load_checkpoint("dummy:tiny", seed=0)  # = ReferenceStepForward's weights
    plan = resolve_plan(profile.model, ckpt.config)
    ring = ring_geometry(profile)
    with shm_region(ring) as transport:
        if device == "cpu":
            geometry = loop_geometry(profile, plan, ckpt.config)
            ring_bytes = torch.frombuffer(transport.buffer, dtype=torch.uint8)
            step = LoopStep.assemble(
                geometry, ReferenceStepForward(geometry), ring_bytes, RingLayout.of(ring), engine_seed=1
            )
            server = LoopEngineServer(
                RingRegion.attach(transport, ring), step.state, geometry, mode=profile.engine_mode,
                host_step=step.host_step, heartbeat_interval_s=0.02,
            )  # fmt: skip
            del ring_bytes
        else:
            server = build_loop_server(profile, ckpt, plan, transport, heartbeat_interval_s=0.02)
        stop = threading.Event()
        thread, errors = _serve(server, stop)
        try:
            yield server, transport, ring, ckpt, plan, stop
        finally:
            stop.set()
            thread.join(60)
            assert not thread.is_alive(), "loop server did not stop"
            assert not errors, errors
            server.close()


def _reference_streams(ckpt, plan, requests):
    """Greedy token streams of the CPU reference engine for (request_id, prompt, params)."""
    import torch

    from blink_appliance.engine.llm_engine import EngineConfig, LLMEngine
    from blink_appliance.engine.request import Request
    from blink_appliance.model.loaders import build_model

    model = build_model(ckpt, torch.float32, "cpu")
    engine = LLMEngine(
        model,
        EngineConfig(
            block_size=plan.block_size, num_kv_blocks=plan.num_kv_blocks, max_num_seqs=plan.max_seqs,
            max_num_batched_tokens=plan.max_num_batched_tokens, max_model_len=plan.max_model_len,
        ),
    )  # fmt: skip
    for rid, prompt, params in requests:
        engine.add_request(Request(rid, prompt, params))
    out: dict[int, list] = {rid: [] for rid, _, _ in requests}
    while engine.has_unfinished():
        for e in engine.step():
            out[e.request_id].append((e.token_id, e.finish_reason))
    return out


TIMEOUT_S = 120.0  # a stream that never ends fails the test instead of hanging it


async def _drain(stream) -> list:
    async def all_events() -> list:
        return [e async for e in stream]

    return await asyncio.wait_for(all_events(), TIMEOUT_S)


async def _collect(client, rid):
    return await _drain(client.stream(rid))


HAVE_GPU_STACK = (
    torch.cuda.is_available()
    and importlib.util.find_spec("cupy") is not None
    and importlib.util.find_spec("cuda.bindings") is not None
)
# The CPU variants run the loop's kernels under the Triton interpreter, which this module turns on
# only where there is no GPU; on a GPU host the cuda variants cover the same path.
cpu_harness = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU harness (Triton interpreter)")
on_gpu = [
    pytest.mark.gpu,
    pytest.mark.skipif(not HAVE_GPU_STACK, reason="needs a CUDA GPU with cupy and cuda-bindings (GPU extra)"),
]


@pytest.mark.parametrize(
    "device, mode",
    [
        pytest.param("cpu", "host", id="cpu-host", marks=cpu_harness),
        pytest.param("cuda:0", "host", id="cuda-host", marks=on_gpu),
        pytest.param("cuda:0", "loop", id="cuda-loop", marks=on_gpu),
    ],
)
async def test_greedy_streams_through_the_loop_equal_the_reference_engine_and_cancel_and_shutdown_work(
    device, mode
):
    from blink_appliance.engine.request import SamplingParams
    from blink_appliance.transport.engine_client import EngineClient

    # Long enough outputs that the request in flight at shutdown is still running when the stop
    # reaches the loop (the tiny model makes a GPU loop step about 0.1 ms).
    limits = {"max_model_len": 1024, "max_output_tokens": 1000}
    with served_tiny_loop(device, limits, mode=mode) as (server, transport, ring, ckpt, plan, stop):
        client = EngineClient.attach(transport, ring)
        await client.start()
        await _wait_async(lambda: client.engine_alive, "the loop server did not come up")

        # Greedy requests of different lengths, together: three for two sequences per step, so one
        # waits in a slot; the longest prompt is prefilled in chunks of the 16-token budget.
        prompts = [[5, 17, 33, 2, 9, 100, 7], [44, 3, 8], list(range(10, 30))]
        params = [
            SamplingParams(temperature=0.0, max_tokens=4),
            SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True),
            SamplingParams(temperature=0.0, max_tokens=2),
        ]
        ids = [client.submit(p, sp) for p, sp in zip(prompts, params, strict=True)]
        got = await asyncio.gather(*(_collect(client, rid) for rid in ids))
        want = _reference_streams(ckpt, plan, list(zip(ids, prompts, params, strict=True)))
        for rid, events in zip(ids, got, strict=True):
            assert [(e.token_id, e.finish_reason) for e in events] == want[rid], (rid, events)
            assert all(e.error is None for e in events)
            stamps = [e.timestamp_ns for e in events if e.token_id is not None]
            assert stamps == sorted(stamps) and 0 < stamps[0] <= time.monotonic_ns()  # host clock

        # Cancel one while it decodes.
        rid = client.submit([7, 7, 7], SamplingParams(temperature=0.0, max_tokens=1000, ignore_eos=True))
        stream = client.stream(rid)
        first = await asyncio.wait_for(stream.__anext__(), TIMEOUT_S)
        assert first.token_id is not None
        client.cancel(rid)
        rest = await _drain(stream)
        assert rest[-1].finish_reason is FinishReason.ABORT and rest[-1].error is None
        assert len(rest) < 1000

        # Shutdown with a request in flight: exactly one terminal, ABORT + shutdown. The daemon's way,
        # the ring's shutdown word, which the loop reads every iteration (the GPU loop makes the
        # tiny model's 1000 tokens in about 15 ms, less than a host thread may take to wake up).
        live = client.stream(client.submit([3, 1, 4], SamplingParams(max_tokens=1000, ignore_eos=True)))
        await asyncio.wait_for(live.__anext__(), TIMEOUT_S)
        client.region.store("shutdown", 1)
        stopping = time.monotonic()
        events = await _drain(live)
        assert [e.finish_reason for e in events if e.finish_reason is not None] == [FinishReason.ABORT]
        assert events[-1].finish_reason is FinishReason.ABORT and "shutdown" in events[-1].error
        await _wait_async(lambda: server.report.state == EngineState.STOPPED, "server did not stop")
        if mode == "loop":
            assert time.monotonic() - stopping < 1.0  # the launched loop stops within a second
        assert server.report.left_open == 0  # the loop itself published every terminal
        telemetry = client.telemetry()
        assert telemetry["requests_admitted"] == 5 and telemetry["requests_cancelled"] >= 1
        assert telemetry["generated_tokens"] >= sum(len(w) for w in want.values())
        await client.close()


async def _wait_async(predicate, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.01)


@cpu_harness
async def test_the_engine_process_serves_the_loop_in_host_mode_and_stops_on_sigterm(tmp_path):
    """What `up` starts for a loop profile: its own process, on a region this test creates."""
    import signal
    import subprocess
    import sys
    import textwrap

    from blink_appliance.engine.request import SamplingParams
    from blink_appliance.profile import load_profile, ring_geometry
    from blink_appliance.transport.engine_client import EngineClient
    from tests.test_ring_support import unique_name

    name = unique_name()
    path = tmp_path / "loop.toml"
    path.write_text(
        textwrap.dedent(
            f"""
            [appliance]
            shm_name = "{name}"
            [[models]]
            name = "tiny"
            source = "dummy:tiny"
            device = "cpu"
            max_seqs = 2
            max_model_len = 32
            max_num_batched_tokens = 16
            block_size = 4
            kv_budget_gib = 0.001
            [engine]
            mode = "host"
            [frontend]
            max_inflight = 4
            """
        )
    )
    ring = ring_geometry(load_profile(path))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # the process sets it itself
    with shm_region_named(name, ring) as transport:
        proc = subprocess.Popen([sys.executable, "-m", "blink_appliance.engine_process", str(path)], env=env)
        try:
            # Not the front end's 0.8 s liveness limit: on a loaded 2-core host the engine's heartbeat
            # once stood still that long during its first interpreted step (a fresh-clone CI run,
            # 2026-11-25). This test is about serving and stopping; a dead engine still fails it.
            client = EngineClient.attach(transport, ring, dead_after_s=60.0)
            await client.start()
            await _wait_async(lambda: client.engine_alive, "the engine process did not come up", timeout=120)
            live = client.stream(client.submit([1, 2], SamplingParams(max_tokens=20, ignore_eos=True)))
            first = await asyncio.wait_for(live.__anext__(), TIMEOUT_S)
            assert first.token_id is not None and first.finish_reason is None
            proc.send_signal(signal.SIGTERM)
            rest = await _drain(live)
            assert rest[-1].finish_reason is FinishReason.ABORT and "shutdown" in rest[-1].error
            assert len(rest) < 19
            assert proc.wait(30) == 0
            assert transport.load_u64(208) == EngineState.STOPPED  # engine_state
            await client.close()
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
