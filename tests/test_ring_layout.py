"""The binary layout and the shared-memory transport."""

from __future__ import annotations

import multiprocessing as mp
import os
import re
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from blink_appliance.wire.region import RingRegion
from blink_appliance.wire.ring_layout import (
    CHANNEL_CTL,
    CHANNEL_PROGRESS,
    CHANNEL_STATUS,
    CONTROL,
    MAGIC,
    STEP_TIME_FIELDS,
    TELEMETRY_FIELDS,
    RingGeometry,
    RingLayout,
    region_size,
)
from blink_appliance.wire.shm_transport import RegionInUseError, ShmTransport
from tests.ring_support import SMALL, shm_region, unique_name

PROTOCOL_MD = Path(__file__).resolve().parents[1] / "docs" / "protocol.md"


def _polled_words(dtype: np.dtype) -> list[tuple[str, int]]:
    return [(n, off) for n, (t, off, *_) in dtype.fields.items() if t.base == np.dtype("<u8")]


def test_every_u64_is_8_byte_aligned_and_sections_are_cache_line_aligned():
    layout = RingLayout.of(
        RingGeometry(
            request_slots=3,
            arena_tokens=7,
            max_prompt_tokens=5,
            max_inflight=5,
            max_output_tokens=3,
            max_stop_ids=3,
        )
    )
    for dtype in (CONTROL, layout.request, CHANNEL_CTL, CHANNEL_PROGRESS, CHANNEL_STATUS):
        assert dtype.itemsize % 8 == 0
        for name, offset in _polled_words(dtype):
            assert offset % 8 == 0, name
    for section in ("records", "arena", "chan_ctl", "chan_prog", "chan_stat", "tokens", "times"):
        assert getattr(layout, section) % 64 == 0, section
    assert layout.request.fields["seq"][1] == 0  # the word written last opens the record
    assert layout.size == region_size(layout.geometry)
    sections = sorted(
        [
            layout.records,
            layout.arena,
            layout.chan_ctl,
            layout.chan_prog,
            layout.chan_stat,
            layout.tokens,
            layout.times,
        ]
    )
    assert sections[0] >= CONTROL.itemsize and len(set(sections)) == 7


def test_geometry_rejects_bad_capacities():
    with pytest.raises(ValueError, match="max_inflight"):
        RingGeometry(max_inflight=0)
    with pytest.raises(ValueError, match="max_prompt_tokens"):
        RingGeometry(arena_tokens=16, max_prompt_tokens=32)


def test_protocol_md_tables_match_the_layout():
    """docs/protocol.md lists `| offset | field | type |` rows; each must match the dtypes."""
    text = PROTOCOL_MD.read_text()
    rows = re.findall(r"^\| (\d+) \| `(\w+)` \| (\w+)", text, flags=re.M)
    assert len(rows) > 40
    known = {}
    for dtype in (CONTROL, RingLayout.of(SMALL).request, CHANNEL_CTL, CHANNEL_PROGRESS, CHANNEL_STATUS):
        for name, (_kind, off, *_) in dtype.fields.items():
            known.setdefault(name, set()).add(off)
    for offset, name, _kind in rows:
        assert name in known, f"protocol.md names unknown field {name}"
        assert int(offset) in known[name], f"protocol.md: {name} at {offset}, layout says {known[name]}"


def test_protocol_md_lists_the_telemetry_words_in_layout_order():
    """The block's order is wire format, whatever groups the code builds it from."""
    text = " ".join(PROTOCOL_MD.read_text().split())
    found = re.search(r"\(`TELEMETRY_FIELDS`, at 392 \+ 8 i\): (.*?), then the step-time histogram", text)
    assert found, "protocol.md no longer lists the telemetry words"
    names = tuple(item.split(" (")[0].strip() for item in found.group(1).split(","))
    assert names == TELEMETRY_FIELDS[: len(names)]
    assert TELEMETRY_FIELDS[len(names) :] == STEP_TIME_FIELDS


def test_region_create_and_attach_checks_geometry():
    name = unique_name()
    transport = ShmTransport.create(name, region_size(SMALL))
    try:
        RingRegion.create(transport, SMALL)
        assert transport.load_u64(0) == MAGIC
        RingRegion.attach(transport, SMALL)
        other = RingGeometry(**{**SMALL.__dict__, "max_output_tokens": 32})
        with pytest.raises(ValueError, match="max_output_tokens"):
            RingRegion.attach(transport, other)
    finally:
        transport.close()


def test_telemetry_reader_waits_for_a_writer_descheduled_mid_write():
    # On a 2-core host the engine can be preempted between its two seqlock stores; the reader must
    # yield until the writer finishes, not give up after a burst of spins (a CI failure, stop 14).
    with shm_region() as transport:
        region = RingRegion.attach(transport, SMALL)
        region.write_telemetry({"generated_tokens": 1})
        seq = region.load("telemetry_seq")
        region.store("telemetry_seq", seq + 1)  # a write begun...
        region.transport.write(RingLayout.control("t_generated_tokens"), (7).to_bytes(8, "little"))

        def finish() -> None:
            time.sleep(0.05)  # ...and finished 50 ms later
            region.store("telemetry_seq", seq + 2)

        writer = threading.Thread(target=finish)
        writer.start()
        assert region.read_telemetry()["generated_tokens"] == 7
        writer.join()


def test_telemetry_left_mid_write_by_a_dead_writer_times_out_and_the_next_write_recovers():
    with shm_region() as transport:
        region = RingRegion.attach(transport, SMALL)
        region.store("telemetry_seq", 5)  # odd: the writer died between its two stores
        with pytest.raises(TimeoutError, match="still being written after 0.05 s"):
            region.read_telemetry(timeout_s=0.05)
        region.write_telemetry({"generated_tokens": 3})  # a restarted engine's first write
        assert region.load("telemetry_seq") % 2 == 0
        assert region.read_telemetry(timeout_s=0.05)["generated_tokens"] == 3


def test_shm_transport_roundtrip_and_bounds():
    transport = ShmTransport.create(unique_name(), 4096)
    try:
        transport.store_u64(64, 2**64 - 1)
        assert transport.load_u64(64) == 2**64 - 1
        transport.write(100, b"abc")
        assert transport.read(99, 5) == b"\0abc\0"
        with pytest.raises(ValueError, match="aligned"):
            transport.load_u64(4)
        with pytest.raises(ValueError, match="outside"):
            transport.write(4094, b"xyz")
    finally:
        transport.close()


def _open_write_exit(name: str) -> None:
    t = ShmTransport.open(name)
    t.store_u64(8, 42)
    t.close()


def _create_and_crash(name: str) -> None:
    ShmTransport.create(name, 4096).store_u64(0, 7)
    import os

    os._exit(0)  # no close: the segment stays behind, its owner gone


def test_other_process_closing_does_not_unlink_and_owner_close_does():
    ctx = mp.get_context("spawn")
    name = unique_name()
    owner = ShmTransport.create(name, 4096)
    try:
        p = ctx.Process(target=_open_write_exit, args=(name,))
        p.start()
        p.join(30)
        assert p.exitcode == 0
        assert owner.load_u64(8) == 42
        again = ShmTransport.open(name)  # still there after the other process exited
        again.close()
    finally:
        owner.close()
    with pytest.raises(FileNotFoundError):
        ShmTransport.open(name)


def test_stale_segment_is_replaced_and_live_one_is_refused():
    ctx = mp.get_context("spawn")
    name = unique_name()
    p = ctx.Process(target=_create_and_crash, args=(name,))
    p.start()
    p.join(30)
    stale = ShmTransport.open(name)
    assert stale.load_u64(0) == 7
    stale.close()
    fresh = ShmTransport.create(name, 4096)  # owner dead -> replaced, zeroed
    try:
        assert fresh.load_u64(0) == 0
        with pytest.raises(RegionInUseError, match="in use"):
            ShmTransport.create(name, 4096)
    finally:
        fresh.close()


def test_step_time_buckets_cover_a_cpu_step():
    """A CPU reference step (tens to hundreds of ms) lands in a bounded bucket, not in +Inf."""
    from blink_appliance.wire.ring_layout import STEP_TIME_BOUNDS_US, step_time_bucket

    assert all(b == 2 * a for a, b in zip(STEP_TIME_BOUNDS_US, STEP_TIME_BOUNDS_US[1:], strict=False))
    assert STEP_TIME_BOUNDS_US[0] == 32 and STEP_TIME_BOUNDS_US[-1] >= 16_000_000
    assert len(STEP_TIME_FIELDS) == len(STEP_TIME_BOUNDS_US) + 1
    # An idle-host CPU step, a slow one, and one on a host loaded by other work.
    for step_ms, bound_us in ((75, 131072), (300, 524288), (4_800, 8388608)):
        bucket = step_time_bucket(step_ms * 1_000_000)
        assert bucket < len(STEP_TIME_BOUNDS_US) and STEP_TIME_BOUNDS_US[bucket] == bound_us, step_ms
    assert step_time_bucket(20_000_000_000) == len(STEP_TIME_BOUNDS_US)  # past the top: +Inf
    assert CONTROL.itemsize == 704  # the block grew from 640 bytes with the bounds (docs/protocol.md)


def test_a_segment_of_another_user_is_refused_naming_its_owner(monkeypatch):
    """Issue 20 defect 8: another local user's segment under our name (a fake header naming a live
    pid) is not trusted, nor removed; the error says whose it is and what to do."""
    import blink_appliance.wire.shm_transport as shm_transport

    name = unique_name()
    squatter = ShmTransport.create(name, 4096)
    try:
        monkeypatch.setattr(shm_transport.os, "getuid", lambda: os.geteuid() + 1)
        with pytest.raises(
            RegionInUseError, match=r"belongs to uid \d+, not to this user.*appliance.shm_name"
        ):
            ShmTransport.create(name, 4096, replace_stale=True)
    finally:
        monkeypatch.undo()
        squatter.close()
