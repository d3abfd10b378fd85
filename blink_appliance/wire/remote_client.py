"""An EngineClient over a transport whose link can fail (NIXL across a network): the ring logic is
EngineClient's; this adds what a lost link means. Every call that reaches the region may raise
TransportLost; then every open stream ends at once with that error (no word can be written), the
engine counts as unavailable (503 for new requests), and nothing touches the region until `rebind`
hands the client the same engine's region through a new link (frontend/remote_rings.py)."""

from __future__ import annotations

import logging

from blink_appliance.wire.channels import ChannelBounds
from blink_appliance.wire.client import EngineClient, EngineDeadError
from blink_appliance.wire.region import RingRegion
from blink_appliance.wire.request import FinishReason, SamplingParams
from blink_appliance.wire.ring_cursor import RingCursor
from blink_appliance.wire.transport import TransportLost

log = logging.getLogger(__name__)


class RemoteEngineClient(EngineClient):
    @property
    def link_lost(self) -> str | None:
        """Why the link failed, until `rebind` (None: it works)."""
        return self._lost

    def rebind(self, region: RingRegion) -> None:
        """Go on over `region`, the same engine's region reached through a new link: every stream open
        when the old one was lost has ended, and what the client knew of the ring is rebuilt from the
        region, as a restarted front end's would be (EngineClient.start)."""
        if region.geometry != self.geometry:
            raise ValueError(f"rebind to a region of geometry {region.geometry}, not {self.geometry}")
        self.region = region
        self._tracked_gen[:] = 0
        self._delivered[:] = 0
        self._bounds = ChannelBounds(self.geometry.max_inflight)
        self._by_slot.clear()
        self._free.clear()
        self._ring = RingCursor(region, self._ring_repair_limit_s)
        self._take_region()
        self._lost = None
        self._control_checked_ns = 0
        self._wake()

    def submit(self, prompt_token_ids: list[int], params: SamplingParams, priority: int = 0) -> int:
        try:
            return super().submit(prompt_token_ids, params, priority)
        except TransportLost as e:  # mid-publish: the request was never accepted
            self._link_failed(str(e))
            raise EngineDeadError(f"engine is not reachable ({self._why_dead()})") from None

    def cancel(self, request_id: int) -> None:
        try:
            super().cancel(request_id)
        except TransportLost as e:  # the stream ends with the link's error instead
            self._link_failed(str(e))

    @property
    def engine_alive(self) -> bool:
        """Once the pump runs, its last reading (at most control_interval_s old): each fresh one costs
        two round trips, and a submit, /health and /metrics each ask."""
        if self._lost is not None:
            return False
        if self._pump is not None and self._control_checked_ns:
            return self._alive
        try:
            return super().engine_alive
        except TransportLost as e:
            self._link_failed(str(e))
            return False

    def _why_dead(self) -> str:
        try:
            if self._lost is None:
                return super()._why_dead()
        except TransportLost as e:
            self._link_failed(str(e))
        return f"the link to the engine host is lost: {self._lost}"

    def telemetry(self) -> dict[str, int | float]:
        try:
            return super().telemetry()
        except TransportLost as e:
            self._link_failed(str(e))
            return {"engine_alive": 0, "payload_waits": self.payload_waits, "inflight": len(self._by_slot)}

    def _pump_pass(self, now: int) -> None:
        try:
            super()._pump_pass(now)
        except TransportLost as e:
            self._link_failed(str(e))

    def _link_failed(self, why: str) -> None:
        """The link is gone: every open stream ends now with its error, without a word written; the
        slots come back with `rebind`."""
        if self._lost is not None:
            return
        self._lost = why
        log.error("lost the link to the engine host: %s", why)
        for pending in self._by_id.values():
            pending.terminate(
                FinishReason.ERROR, f"engine_failure: the link to the engine host is lost ({why})"
            )


__all__ = ["RemoteEngineClient"]
