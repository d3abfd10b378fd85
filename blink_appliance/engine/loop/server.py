"""Engine side of the rings for the GPU loop: take the region, launch, watch, stop (the loop's
counterpart of engine/reference/server.py, which serves the CPU reference engine).

The loop's kernels do the token path themselves: schedule reads records from the mapped ring,
commit writes tokens, counts and terminal events into it (engine/loop/state.py). What is left
for the host is the life cycle around it, in one of two modes over the same kernels:

- "loop": the DeviceLoop graph is launched once. This thread then only writes the heartbeat,
  copies the loop's counters into the ring's telemetry words (on a side stream: it never waits for
  the loop), and watches for shutdown and for the loop's end or failure.
- "host": this thread runs one loop iteration per call (`host_step`, which waits for it), the
  vLLM-style baseline; with nothing to do it polls the ring with short sleeps.

Life cycle, as EngineServer's (wire/lifecycle.py ServerLifecycle, docs/protocol.md): a new epoch,
channels a dead epoch left open get engine_restarted, RUNNING once the loop serves. Shutdown arrives
as the ring's shutdown word, or as `stop` (SIGTERM), which this server turns into that word because
the kernels read only the ring. The loop then marks every slot FINISHING and commit publishes ABORT + shutdown
for each; records still queued are drained here; STOPPED. A failure (an exception here, a CUDA error
of the loop) marks the region FAILED and, once the token path has stopped, fails every request the
loop held with engine_failure; queued records stay for the next epoch.
"""

from __future__ import annotations

import logging
import os
import secrets
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, Protocol

import torch

from blink_appliance.engine.loop.progress import stage
from blink_appliance.engine.loop.state import COUNTER_INDEX, DeviceState, LoopGeometry, SlotState
from blink_appliance.wire.lifecycle import (
    FRONTEND_TIMEOUT_S,
    HEARTBEAT_INTERVAL_S,
    ServerLifecycle,
    drain_ring,
    finish_open_channels,
    request_shutdown,
    withdraw_shutdown_request,
)
from blink_appliance.wire.region import RingRegion
from blink_appliance.wire.request import FinishReason
from blink_appliance.wire.ring_layout import ENGINE_COUNTER_FIELDS, STEP_TIME_FIELDS, EngineState, ErrorCode

if TYPE_CHECKING:
    from blink_appliance.engine.plan import ModelPlan
    from blink_appliance.model.loaders import Checkpoint
    from blink_appliance.profile import Profile
    from blink_appliance.wire.shm_transport import ShmTransport

log = logging.getLogger(__name__)

LoopMode = Literal["loop", "host"]


class DeviceLoopLike(Protocol):
    """What this server uses of engine/loop/graph.py's DeviceLoop (launch once, then watch)."""

    def launch(self) -> None: ...
    def running(self) -> bool: ...  # raises on a CUDA error of the loop
    def join(self, timeout_s: float | None = None) -> bool: ...
    def close(self) -> None: ...


class Closeable(Protocol):
    def close(self) -> None: ...


class LoopSnapshot:
    """The loop's counters, slot states, free-block count and step-time histogram, copied to host memory.

    On a CUDA device the copies run on a stream of their own into pinned memory and only that
    stream is waited for, so reading never waits for the loop's graph; the values of one snapshot
    may come from different iterations (fine for telemetry). On the CPU (mode "host" under the
    Triton interpreter) they are plain copies between steps.
    """

    def __init__(self, state: DeviceState) -> None:
        self._sources = (
            state.counters,
            state.slot_state,
            state.free_top,
            state.step_time_hist,
            state.lru_words,
        )
        cuda = state.counters.is_cuda
        self._host = tuple(torch.empty_like(t, device="cpu", pin_memory=cuda) for t in self._sources)
        self._stream = torch.cuda.Stream(state.counters.device) if cuda else None

    def read(self) -> tuple[list[int], list[int], int, list[int], int]:
        """(counters in COUNTERS order, slot states, free_top, steps per step-time bucket, cached blocks
        nobody holds)."""
        if self._stream is not None:
            with torch.cuda.stream(self._stream):
                for host, source in zip(self._host, self._sources, strict=True):
                    host.copy_(source, non_blocking=True)
            self._stream.synchronize()
        else:
            for host, source in zip(self._host, self._sources, strict=True):
                host.copy_(source)
        counters, slots, free_top, step_times, lru_words = self._host
        return counters.tolist(), slots.tolist(), int(free_top[0]), step_times.tolist(), int(lru_words[2])


def telemetry_values(
    counters: list[int],
    slot_states: list[int],
    free_top: int,
    num_kv_blocks: int,
    step_times: list[int],
    cached: int = 0,
) -> dict[str, int]:
    """The ring's telemetry words (ring_layout.TELEMETRY_FIELDS) from a loop snapshot; last_step_ns and
    the step-time histogram are the device's own (schedule start to commit), in both modes."""
    values = {name: int(counters[COUNTER_INDEX[name]]) for name in ENGINE_COUNTER_FIELDS}
    values["running"] = sum(1 for s in slot_states if s == SlotState.RUNNING)
    values["waiting"] = sum(1 for s in slot_states if s == SlotState.WAITING)
    values["kv_blocks_total"] = num_kv_blocks
    values["kv_blocks_used"] = num_kv_blocks - free_top - cached
    values["kv_blocks_cached"] = cached
    values.update(zip(STEP_TIME_FIELDS, step_times, strict=True))
    return values


@dataclass
class StopReport:
    """How the last run ended, for logs and tests."""

    state: EngineState = EngineState.ABSENT
    drained_records: int = 0  # records still queued at shutdown, finished here
    # Channels the loop left open after a clean stop: commit should have finished each one, so
    # anything here is a loop bug; they are finished here (ABORT, shutdown) so no client hangs.
    left_open: int = 0
    failed_requests: int = 0  # requests failed with engine_failure after a failure


class LoopEngineServer:
    def __init__(
        self,
        region: RingRegion,
        state: DeviceState,
        geometry: LoopGeometry,
        *,
        mode: LoopMode,
        host_step: Callable[[], None] | None = None,
        device_loop: DeviceLoopLike | None = None,
        clock_offset_ns: Callable[[], int] | None = None,
        heartbeat_interval_s: float = HEARTBEAT_INTERVAL_S,
        telemetry_interval_s: float = 0.05,
        idle_sleep_s: float = 0.0005,
        frontend_timeout_s: float = FRONTEND_TIMEOUT_S,
        stop_timeout_s: float = 5.0,
        owned: Sequence[Closeable] = (),
    ) -> None:
        if mode == "loop" and device_loop is None:
            raise ValueError("mode 'loop' needs the built DeviceLoop")
        if mode == "host" and host_step is None:
            raise ValueError("mode 'host' needs host_step (LoopStep.host_step)")
        if mode not in ("loop", "host"):
            raise ValueError(f"mode must be 'loop' or 'host', got {mode!r}")
        self.region = region
        self.state = state
        self.geometry = geometry
        self.mode = mode
        self.host_step = host_step
        self.device_loop = device_loop
        self.clock_offset_ns = clock_offset_ns
        self.idle_sleep_s = idle_sleep_s
        self.stop_timeout_s = stop_timeout_s
        self.snapshot = LoopSnapshot(state)
        self._lifecycle = ServerLifecycle(
            region,
            self._telemetry_values,
            heartbeat_interval_s=heartbeat_interval_s,
            telemetry_interval_s=telemetry_interval_s,
            frontend_timeout_s=frontend_timeout_s,
        )
        self.report = StopReport()
        self._owned = list(owned)  # closed by close(), last first (e.g. the mapped ring after the loop)
        self.step: object | None = None  # the LoopStep, when built here: kept alive with the server

    # -- the whole run ----------------------------------------------------------------------------
    def run(self, stop: threading.Event) -> None:
        """Serve until `stop` is set or the ring's shutdown word is written."""
        heartbeat = self._lifecycle.heartbeat
        launched = False
        try:
            self._start()
            if self.mode == "loop":
                assert self.device_loop is not None
                self.device_loop.launch()
                launched = True
                self._lifecycle.serving()
                self._watch_loop(stop)
            else:
                heartbeat.start()  # a thread: a long step must not look like death
                self._lifecycle.serving()
                self._drive(stop)
            if not self.region.load("shutdown"):
                raise RuntimeError("the loop ended without a shutdown request (keep_running went to 0)")
            self._finish_stopped()
        except BaseException as exc:
            log.exception("loop engine failed")
            self._fail(exc, launched)
            raise
        finally:
            heartbeat.stop()
            withdraw_shutdown_request(self.region)

    def close(self) -> None:
        """Release what the server owns (the loop's graph, the ring's GPU mapping) once the loop
        has ended; after a failure that left the loop running, leave them to process exit."""
        if self.device_loop is not None:
            try:
                if self.device_loop.running():
                    log.error("the device loop is still running; not releasing its resources")
                    return
            except RuntimeError:
                pass  # a CUDA error: nothing of the context can be released cleanly either way
        while self._owned:
            resource = self._owned.pop()
            try:
                resource.close()
            except Exception:
                log.exception("releasing %r failed", resource)
        self.step = None
        self.device_loop = None
        self.host_step = None

    def _start(self) -> None:
        """Take over the region for a new epoch; RUNNING comes once the token path runs."""
        self._lifecycle.begin()
        if self.clock_offset_ns is not None:
            # Commit stamps tokens with the device clock plus this offset: host CLOCK_MONOTONIC ns.
            self.state.clock_offset_ns.fill_(self.clock_offset_ns())

    # -- mode "loop": launched once, this thread only watches --------------------------------------
    def _watch_loop(self, stop: threading.Event) -> None:
        assert self.device_loop is not None
        lifecycle = self._lifecycle
        interval = min(lifecycle.heartbeat.interval_s, lifecycle.telemetry.interval_s)
        while self.device_loop.running():
            lifecycle.heartbeat.beat()
            lifecycle.maybe_write_telemetry()
            self._reclaim_if_frontend_lost()
            if stop.is_set():
                self._stop_token_path()
                return
            stop.wait(interval)

    # -- mode "host": one loop iteration per call ---------------------------------------------------
    def _drive(self, stop: threading.Event) -> None:
        assert self.host_step is not None
        r = self.region
        stopping_since: float | None = None
        while int(self.state.keep_running[0]):
            if stop.is_set():
                request_shutdown(r)
            if stopping_since is None and r.load("shutdown"):
                stopping_since = time.monotonic()
            elif stopping_since is not None and time.monotonic() - stopping_since > self.stop_timeout_s:
                raise TimeoutError(f"the loop did not stop within {self.stop_timeout_s} s of shutdown")
            idle = (
                int(self.state.num_active[0]) == 0
                and r.load("req_head") == r.load("req_tail")
                and not r.load("shutdown")
            )
            if idle:
                self._reclaim_if_frontend_lost()
                self._lifecycle.maybe_write_telemetry()
                stop.wait(self.idle_sleep_s)
                continue
            self.host_step()
            self._reclaim_if_frontend_lost()
            self._lifecycle.maybe_write_telemetry()

    # -- stopping and failing -----------------------------------------------------------------------
    def _stop_token_path(self) -> None:
        """Ask the loop to stop through the ring and wait for it (it publishes every slot's terminal)."""
        assert self.device_loop is not None
        request_shutdown(self.region)
        if not self.device_loop.join(self.stop_timeout_s):
            raise TimeoutError(f"the device loop did not stop within {self.stop_timeout_s} s of shutdown")

    def _finish_stopped(self) -> None:
        r = self.region
        self.report.drained_records = drain_ring(
            r, FinishReason.ABORT, ErrorCode.SHUTDOWN, "engine shut down"
        )
        left = finish_open_channels(r, FinishReason.ABORT, ErrorCode.SHUTDOWN, "engine shut down")
        self.report.left_open = len(left)
        if left:
            log.error(
                "the loop stopped with %d requests unfinished (slots %s); finished them here", len(left), left
            )
        self._lifecycle.stopped()
        self.report.state = EngineState.STOPPED

    def _fail(self, exc: BaseException, launched: bool) -> None:
        """FAILED first (the front end stops submitting), then fail what the loop held once it is
        certain no kernel writes the channels any more."""
        self._lifecycle.failed()
        self.report.state = EngineState.FAILED
        if launched and not self._device_loop_stopped():
            log.error("the device loop did not stop; its requests end when this process does")
            return
        detail = f"engine failed: {exc!r}"
        failed = finish_open_channels(self.region, FinishReason.ERROR, ErrorCode.ENGINE_FAILURE, detail)
        self.report.failed_requests = len(failed)

    def _device_loop_stopped(self) -> bool:
        assert self.device_loop is not None
        try:
            if not self.device_loop.running():
                return True
            request_shutdown(self.region)
            return self.device_loop.join(self.stop_timeout_s)
        except RuntimeError:
            return True  # a CUDA error: the context is gone, and no kernel of it runs any more

    # -- front end liveness ---------------------------------------------------------------------------
    def _reclaim_if_frontend_lost(self) -> None:
        """The front end's heartbeat went stale while requests are open: cancel them all through
        their cancel words (the loop honours those like a client cancel) so their slots come free."""
        if not self._lifecycle.frontend.lost():
            return
        r = self.region
        ctl, prog = r.ctl_table(), r.progress_table()
        open_slots = (ctl["generation"] != prog["done"]) & (ctl["cancel"] != ctl["generation"])
        slots = [int(s) for s in open_slots.nonzero()[0]]
        if slots:
            log.warning("front end heartbeat stale; cancelling %d requests", len(slots))
            for slot in slots:
                r.store_ctl(slot, "cancel", int(ctl["generation"][slot]))

    # -- telemetry ------------------------------------------------------------------------------------
    def _telemetry_values(self) -> dict[str, int]:
        counters, slots, free_top, step_times, cached = self.snapshot.read()
        return telemetry_values(counters, slots, free_top, self.geometry.num_kv_blocks, step_times, cached)


def build_loop_server(
    profile: Profile,
    checkpoint: Checkpoint,
    plan: ModelPlan,
    transport: ShmTransport,
    *,
    index: int = 0,
    **options: float,
) -> LoopEngineServer:
    """Everything the GPU loop serves models[index] with, from the profile: weights on the device, KV
    cache, the loop's state and kernels (LoopStep), its ring region mapped into the GPU, the forward
    graphs and, in mode "loop", the DeviceLoop graph (captured, not launched: run() launches it)."""
    from blink_appliance.engine.loop.geometry import loop_geometry
    from blink_appliance.engine.loop.step import LoopStep
    from blink_appliance.model.gpu_weights import GpuWeights
    from blink_appliance.profile import ProfileError, ring_geometry
    from blink_appliance.wire.ring_layout import RingLayout

    mode, model = profile.engine_mode_of(index), profile.models[index]
    if mode not in ("loop", "host"):
        raise ProfileError(f"engine.mode: {mode!r} is not served by the GPU loop")
    device = torch.device(model.device)
    dtype = getattr(torch, model.dtype)
    if device.type == "cpu":
        if mode == "loop":
            raise ProfileError("engine.mode: 'loop' needs a CUDA device; on 'cpu' use 'host'")
        if os.environ.get("TRITON_INTERPRET") != "1":
            raise ProfileError(
                "engine.mode: 'host' on device 'cpu' runs the loop's Triton kernels in the interpreter: "
                "set TRITON_INTERPRET=1 before the kernels are imported"
            )
    elif not torch.cuda.is_available() or (device.index or 0) >= torch.cuda.device_count():
        raise ProfileError(f"{model.key('device', replica=True)}: {device} is not available on this machine")
    config = checkpoint.config
    geometry = loop_geometry(profile, plan, config, index=index)
    ring = ring_geometry(profile, index)
    region = RingRegion.attach(transport, ring)
    owned: list[Closeable] = []
    try:
        if device.type == "cuda":
            from blink_appliance.engine.loop.control import LoopControl
            from blink_appliance.engine.loop.mapped_region import MappedRegion

            torch.cuda.set_device(device)
            mapped = MappedRegion.of_transport(transport, device)
            owned.append(mapped)
            ring_bytes = mapped.tensor(0, torch.uint8, mapped.size)
            control = LoopControl(device)

            def clock_offset_ns() -> int:
                return control.measure_clock_offset_ns()[0]

            offset: Callable[[], int] | None = clock_offset_ns
        else:
            # The region's own bytes; the commit kernel stamps host time itself under the interpreter.
            ring_bytes = torch.frombuffer(transport.buffer, dtype=torch.uint8)
            offset = None
        ranks = None
        if model.tensor_parallel > 1:
            if mode != "loop":  # profile checks refuse it too
                raise ProfileError(
                    f"{model.key('tensor_parallel')}: the ranks run in engine.mode 'loop' only"
                )
            from blink_appliance.engine.loop.ranks import TensorParallelLoop

            ranks = TensorParallelLoop.build(
                config, checkpoint.weights, ring_bytes, RingLayout.of(ring), geometry, model.rank_devices, dtype,
                engine_seed=secrets.randbits(63),
            )  # fmt: skip
            step = ranks.step
        else:
            with stage(f"weights to {device}"):
                weights = GpuWeights.from_hf(config, checkpoint.weights, dtype, device)
            step = LoopStep.build(
                config, weights, ring_bytes, RingLayout.of(ring), geometry, device, dtype,
                engine_seed=secrets.randbits(63), deterministic=bool(profile.engine.deterministic),
            )  # fmt: skip
        # Compile now, not in the first request's step; and capture only records work, so the
        # loop's graph needs everything compiled and warm before it is built.
        step.warmup()
        device_loop = None
        if mode == "loop":
            from blink_appliance.engine.loop.graph import DeviceLoop
            from blink_appliance.engine.loop.mapped_region import RingWords

            ring_words = RingWords.of(mapped)
            if ranks is not None:
                device_loop = ranks.loops(ring_words, control)
            else:
                with stage("capturing the device loop's graph"):
                    device_loop = DeviceLoop(
                        step.body(),
                        num_active=step.state.num_active,
                        keep_running=step.state.keep_running,
                        ring=ring_words,
                        control=control,
                    )
            owned.append(device_loop)
        server = LoopEngineServer(
            region,
            step.state,
            geometry,
            mode=mode,
            host_step=step.host_step if mode == "host" else None,
            device_loop=device_loop,
            clock_offset_ns=offset,
            owned=owned,
            **options,
        )
    except BaseException:
        for resource in reversed(owned):
            resource.close()
        raise
    server.step = step
    return server
