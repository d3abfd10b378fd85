"""The daemon's supervision of its engine, with a stand-in child (no processes): it clears a stale
shutdown word before an engine starts, marks an engine that exited FAILED before it restarts one, and
rewrites an overwritten region header so the restarted one can attach (issue 20, defects 4 and 6)."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

import pytest
from blink_appliance.frontend.engine_links import RegionPlan, attach_engines, detach_engines
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from blink_appliance.daemon import ApplianceDaemon
from blink_appliance.profile import ProfileError, parse_profile
from blink_appliance.wire.lifecycle import begin_epoch
from blink_appliance.wire.region import RingRegion
from blink_appliance.wire.ring_layout import EngineState
from tests.ring_support import SMALL, shm_region, unique_name


class StandInEngine:
    """Comes up at once when started (a new epoch, RUNNING); records the words it started with."""

    name = "engine"

    def __init__(self, region: RingRegion) -> None:
        self.region = region
        self.restarts: list[float] = []
        self.started_with: list[tuple[int, int]] = []  # (shutdown, engine_state) at each start
        self.code: int | None = None
        self.kills = 0

    def start(self) -> None:
        self.started_with.append((self.region.load("shutdown"), self.region.load("engine_state")))
        RingRegion.attach(self.region.transport, self.region.geometry)  # what every engine does first
        begin_epoch(self.region)  # then takes the region (our pid stands in for the child's)
        self.region.store("engine_state", EngineState.RUNNING)
        self.code = None

    def exited(self) -> int | None:
        return self.code

    pid = os.getpid()

    def kill(self) -> None:
        self.kills += 1
        self.code = -9


MODEL = {"name": "m", "source": "dummy:tiny", "device": "cpu", "kv_budget_gib": 0.01}


def daemon_with(region: RingRegion, tmp_path: Path) -> tuple[ApplianceDaemon, StandInEngine]:
    daemon = ApplianceDaemon(parse_profile({"models": [MODEL]}, origin="test"), tmp_path / "profile.toml")
    daemon.engine = StandInEngine(region)  # type: ignore[assignment]
    return daemon, daemon.engine  # type: ignore[return-value]


def test_a_stale_shutdown_word_does_not_stop_the_engine_the_daemon_starts(tmp_path):
    with shm_region(SMALL) as transport:
        region = RingRegion.attach(transport, SMALL)
        daemon, engine = daemon_with(region, tmp_path)
        region.store("shutdown", 1)  # left by a stray writer, or by the last engine's stop
        daemon._start_engine(region)
        assert [shutdown for shutdown, _ in engine.started_with] == [0]
        daemon._workdir.rmdir()


def test_an_engine_that_exited_is_marked_failed_before_the_next_one_starts(tmp_path):
    with shm_region(SMALL) as transport:
        region = RingRegion.attach(transport, SMALL)
        daemon, engine = daemon_with(region, tmp_path)
        daemon._start_engine(region)
        engine.code = -9  # killed; its state word still says RUNNING
        daemon._stop.wait = _once_then_stop(daemon)  # one supervision round
        daemon._supervise(region)
        assert engine.started_with[-1] == (0, EngineState.FAILED)
        assert region.load("engine_state") == EngineState.RUNNING  # the restarted one
        daemon._workdir.rmdir()


def _once_then_stop(daemon: ApplianceDaemon, rounds: int = 1, pause_s: float = 0.0):
    results = iter([False] * rounds + [True])

    def wait(timeout=None) -> bool:
        time.sleep(pause_s)
        return next(results)

    return wait


def test_an_engine_alive_but_stuck_is_killed_and_restarted(tmp_path):
    """Its heartbeat stands still past the stall limit while the process lives (a hung engine):
    the daemon kills it, marks it FAILED and starts the next one."""
    with shm_region(SMALL) as transport:
        region = RingRegion.attach(transport, SMALL)
        daemon, engine = daemon_with(region, tmp_path)
        daemon.engine_watch.limit_s = 0.3
        daemon._start_engine(region)  # the stand-in never beats
        daemon._stop.wait = _once_then_stop(daemon, rounds=12, pause_s=0.05)
        daemon._supervise(region)
        assert engine.kills >= 1
        assert engine.started_with[1] == (0, EngineState.FAILED)
        daemon._workdir.rmdir()


def test_a_heartbeat_that_moves_is_never_stuck():
    from blink_appliance.daemon import HeartbeatWatch

    with shm_region(SMALL) as transport:
        region = RingRegion.attach(transport, SMALL)
        watch = HeartbeatWatch(0.05)
        for beat in range(1, 6):
            region.store("engine_heartbeat_ns", beat)
            assert watch.stuck_for(region) is None
            time.sleep(0.03)
        time.sleep(0.1)
        assert watch.stuck_for(region) > 0.05


def test_a_corrupt_epoch_word_does_not_stop_the_daemon(tmp_path):
    """Issue 20 defect 6 (random bytes over the region): an epoch word at its maximum overflowed the
    engine's start, and "epoch greater than before" never held again; the daemon gave up."""
    with shm_region(SMALL) as transport:
        region = RingRegion.attach(transport, SMALL)
        daemon, engine = daemon_with(region, tmp_path)
        region.store("engine_epoch", 2**64 - 1)
        daemon._start_engine(region)  # returns once the engine serves
        assert region.load("engine_epoch") == 1 and len(engine.started_with) == 1
        daemon._workdir.rmdir()


@settings(max_examples=20, deadline=None, suppress_health_check=list(HealthCheck))
@given(header=st.binary(min_size=64, max_size=64))
def test_an_overwritten_header_is_rewritten_and_the_restarted_engine_attaches(tmp_path, header):
    """Issue 20 defect 6: random bytes over the region's header. Every process started after that
    refused the region (attach checks the header), so the first restart failed and the daemon gave up."""
    with shm_region(SMALL) as transport:
        region = RingRegion.attach(transport, SMALL)
        daemon, engine = daemon_with(region, tmp_path)
        daemon._start_engine(region)
        transport.write(0, header)
        engine.code = -9  # the engine dies: the daemon restarts it
        daemon._stop.wait = _once_then_stop(daemon)
        daemon._supervise(region)
        assert region.header_fault() is None
        assert len(engine.started_with) == 2 and region.load("engine_state") == EngineState.RUNNING
        daemon._workdir.rmdir()


def test_the_profiles_stall_limit_reaches_the_daemon_and_the_front_ends_clients(tmp_path):
    """engine.stall_limit_s: the daemon's heartbeat watch and each front-end EngineClient take it."""
    profile = parse_profile({"models": [MODEL], "engine": {"stall_limit_s": 42.5}}, origin="test")
    daemon = ApplianceDaemon(profile, tmp_path / "profile.toml")
    assert daemon.engine_watch.limit_s == 42.5
    daemon._workdir.rmdir()
    assert parse_profile({"models": [MODEL]}, origin="test").engine.stall_limit_s == 10.0

    async def client_limit(name: str) -> int:
        plan = RegionPlan("m", name, SMALL)
        links = await attach_engines(
            [plan], request_timeout_s=0.0, stall_limit_s=profile.engine.stall_limit_s
        )
        try:
            return links.links[0].client._watch.stall_limit_ns
        finally:
            await detach_engines(links)

    name = unique_name()
    with shm_region(SMALL, name):
        assert asyncio.run(client_limit(name)) == 42_500_000_000


def test_a_stall_limit_that_is_not_positive_is_a_profile_error_naming_the_key():
    with pytest.raises(ProfileError, match="engine.stall_limit_s"):
        parse_profile({"models": [MODEL], "engine": {"stall_limit_s": 0}}, origin="test")
