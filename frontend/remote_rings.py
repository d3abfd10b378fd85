"""The front end's side of `frontend.transport = "nixl"`: every model's ring region, reached over the
network through one NIXL link to the engine host's ring agent (blink_appliance/ring_agent.py).

The link is made with the shared-secret handshake (wire/handshake.py) and made again whenever it is
lost: a transfer failed or timed out, the agent restarted, the engine host rebooted. While it is
down each model's client reports its engine unavailable (503 for new requests) and its open streams
have ended with an error; once it is back each client is rebound to its region and serves again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import Sequence
from typing import Any

from blink_appliance.profile import ProfileError
from blink_appliance.wire.handshake import HandshakeError, load_secret, request_offer
from blink_appliance.wire.link_settings import DpuSection
from blink_appliance.wire.nixl_agent import NixlUnavailableError, apply_ucx_env, interface_of, make_agent
from blink_appliance.wire.nixl_transport import TRANSFER_TIMEOUT_S, NixlLink
from blink_appliance.wire.region import RingRegion
from blink_appliance.wire.remote_client import RemoteEngineClient
from blink_appliance.wire.ring_layout import RingGeometry

log = logging.getLogger(__name__)

RECONNECT_PAUSE_S = 0.5  # between two tries to reach the agent
# Heartbeat and liveness words once per this long, not every pump pass: each is a round trip here.
CONTROL_INTERVAL_S = 0.01


class RemoteRings:
    def __init__(self, dpu: DpuSection, models: Sequence[str]) -> None:
        try:
            self.secret = load_secret(dpu.secret_file)
        except ValueError as e:
            raise ProfileError(str(e)) from None
        self.dpu = dpu
        self.models = list(models)
        if socket.gethostname() != dpu.frontend_host and interface_of(dpu.frontend_host) is None:
            log.warning("[dpu] frontend_host is %r, which is neither this host's name nor one of its "
                        "addresses: is this the host the profile means?", dpu.frontend_host)  # fmt: skip
        apply_ucx_env(dpu.ucx_env())
        try:
            self.agent: Any = make_agent(NixlLink.agent_name(), progress_thread=False)
        except NixlUnavailableError as e:
            raise ProfileError(f"dpu: {e}") from None
        self.link: NixlLink | None = None

    async def connect(self, *, forever: bool) -> NixlLink:
        """A new link to the agent; retries while the agent cannot be reached (`forever`), and gives up
        at once on a secret the agent refuses unless `forever` (a misconfiguration shows at start)."""
        dpu = self.dpu
        while True:
            try:
                offer = await asyncio.to_thread(
                    request_offer, dpu.dial_address, dpu.port, self.secret, dpu.connect_timeout_s
                )
                link = NixlLink(self.agent, offer, min(dpu.connect_timeout_s, TRANSFER_TIMEOUT_S))
                for model in self.models:
                    link.transport(model)  # every model's region is offered (same profile both ends)
            except HandshakeError as e:
                if not forever:
                    raise ProfileError(f"dpu.secret_file: {e}") from None
                log.error("%s; trying again", e)
            except ValueError as e:
                raise ProfileError(str(e)) from None
            except ConnectionError as e:
                log.warning("%s; trying again in %.1f s", e, RECONNECT_PAUSE_S)
            else:
                log.info("linked to ring agent %s at %s:%d over NIXL (%s)", offer.instance[:12],
                         dpu.dial_address, dpu.port, ", ".join(r.model for r in offer.regions))  # fmt: skip
                return link
            await asyncio.sleep(RECONNECT_PAUSE_S)

    def region(self, link: NixlLink, index: int, geometry: RingGeometry) -> RingRegion:
        return RingRegion.attach(link.transport(self.models[index]), geometry)

    async def supervise(self, clients: Sequence[RemoteEngineClient]) -> None:
        """Make the link again whenever a client finds it lost, and rebind every client to it."""
        while True:
            await asyncio.sleep(0.05)
            if self.link is not None and self.link.lost is None and not any(c.link_lost for c in clients):
                continue
            try:
                await self._relink(clients)
            except Exception:  # noqa: BLE001 - whatever it was, the next round tries again
                log.exception("making the link to the ring agent again failed; trying again")
                await asyncio.sleep(RECONNECT_PAUSE_S)

    async def _relink(self, clients: Sequence[RemoteEngineClient]) -> None:
        if self.link is not None:  # forgotten first: the same agent may take us back under its name
            self.link.close()
            self.link = None
        link = self.link = await self.connect(forever=True)
        for i, client in enumerate(clients):
            try:
                client.rebind(self.region(link, i, client.geometry))
            except (ValueError, ConnectionError) as e:  # a header that does not match, or lost again
                log.error("models[%d]: cannot rebind to the new link: %s", i, e)
                link.mark_lost(str(e))
                return

    def close(self) -> None:
        if self.link is not None:
            with contextlib.suppress(Exception):
                self.link.close()
            self.link = None
        self.agent = None
