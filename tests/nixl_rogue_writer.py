"""Run by tests/test_nixl_frontend_live.py in a process of its own: a rogue front end that knows the
shared secret publishes, through NIXL, one record naming an output channel that does not exist, and
waits for the engine to consume it. Prints one JSON line: the engine's records_unaddressable count
before and its telemetry after, and its state."""

from __future__ import annotations

import json
import sys
import time

from blink_appliance.profile import load_profile, ring_geometry
from blink_appliance.wire.handshake import load_secret, request_offer
from blink_appliance.wire.nixl_agent import make_agent
from blink_appliance.wire.nixl_transport import NixlLink
from blink_appliance.wire.region import RingRegion
from blink_appliance.wire.request import SamplingParams
from blink_appliance.wire.ring_layout import EngineState


def main(profile_path: str, model: str) -> None:
    profile = load_profile(profile_path)
    dpu = profile.dpu
    offer = request_offer(dpu.dial_address, dpu.port, load_secret(dpu.secret_file), 5)
    link = NixlLink(make_agent("rogue-frontend", progress_thread=False), offer)
    index = next(i for i, m in enumerate(profile.models) if m.name == model)
    region = RingRegion.attach(link.transport(model), ring_geometry(profile, index))
    before = region.read_telemetry()["records_unaddressable"]
    head = region.load("req_head")
    record = region.request_record((10**9, 0, 0, 0), (0, 0, 1), SamplingParams(max_tokens=4))
    record[0]["slot"] = region.geometry.max_inflight + 5
    region.publish_record(head, record)
    region.doorbell("req_head", head + 1)
    deadline = time.monotonic() + 30
    while region.load("req_tail") != head + 1 or region.read_telemetry()["records_unaddressable"] == before:
        if time.monotonic() > deadline:
            raise SystemExit("the engine did not consume the record within 30 s")
        time.sleep(0.05)
    after = region.read_telemetry()
    state = EngineState(region.load("engine_state")).name
    link.close()
    print(json.dumps({"before": before, "after": after, "engine_state": state}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
