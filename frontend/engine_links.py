"""The front end's link to each model's engine: the model's ring region and a started EngineClient on
it. With `frontend.transport = "shm"` the region is the shared memory the daemon created on this
host; with "nixl" it is reached over the network through the engine host's ring agent
(remote_rings.py). Start-up needs every one: a region that cannot be opened ends it with a
ProfileError naming the model and the region, and the links made before it are closed again."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field

from blink_appliance.frontend.remote_rings import CONTROL_INTERVAL_S, RemoteRings

from blink_appliance.profile import ProfileError
from blink_appliance.wire.client import EngineClient
from blink_appliance.wire.link_settings import DpuSection
from blink_appliance.wire.remote_client import RemoteEngineClient
from blink_appliance.wire.ring_layout import RingGeometry
from blink_appliance.wire.shm_transport import ShmTransport
from blink_appliance.wire.transport import Transport


@dataclass(frozen=True)
class RegionPlan:
    """Where model `model`'s engine listens: the shm name of its region and its ring geometry."""

    model: str
    region: str
    geometry: RingGeometry
    key: str = "models[0]"  # the profile's section (and replica) it serves, for errors


@dataclass
class EngineLink:
    plan: RegionPlan
    transport: Transport | None  # the shm mapping this link owns (None: the remote rings own theirs)
    client: EngineClient

    @property
    def model(self) -> str:
        return self.plan.model


@dataclass
class EngineLinks:
    """Every model's link, and for remote rings the task that makes their link again when lost."""

    links: list[EngineLink]
    remote: RemoteRings | None = None
    supervisor: asyncio.Task[None] | None = field(default=None, repr=False)

    def __iter__(self) -> Iterator[EngineLink]:
        return iter(self.links)


async def attach_engines(
    plans: Iterable[RegionPlan],
    *,
    request_timeout_s: float,
    stall_limit_s: float,
    dpu: DpuSection | None = None,
) -> EngineLinks:
    """One started EngineClient per region, in the order given: over shared memory, or over NIXL
    when `dpu` says where the ring agent is."""
    plans = list(plans)
    limits = dict(request_timeout_s=request_timeout_s, stall_limit_s=stall_limit_s)
    if dpu is not None:
        return await _attach_remote(plans, limits, dpu)
    links = EngineLinks([])
    try:
        for plan in plans:
            links.links.append(_open(plan, limits))
            await links.links[-1].client.start()
    except BaseException:
        await detach_engines(links)
        raise
    return links


async def _attach_remote(
    plans: Sequence[RegionPlan], limits: dict[str, float], dpu: DpuSection
) -> EngineLinks:
    remote = RemoteRings(dpu, [p.model for p in plans])
    links = EngineLinks([], remote)
    try:
        remote.link = await remote.connect(forever=False)
        for i, plan in enumerate(plans):
            try:
                region = remote.region(remote.link, i, plan.geometry)
            except (OSError, ValueError) as e:  # a region laid out for another geometry (another profile)
                raise ProfileError(
                    f"{plan.key} ({plan.model}): the remote ring region does not match: {e}"
                ) from None
            client = RemoteEngineClient(region, control_interval_s=CONTROL_INTERVAL_S, **limits)
            links.links.append(EngineLink(plan, None, client))
            await client.start()
    except BaseException:
        await detach_engines(links)
        raise
    links.supervisor = asyncio.get_running_loop().create_task(
        remote.supervise([link.client for link in links]), name="remote-rings"
    )
    return links


def _open(plan: RegionPlan, limits: dict[str, float]) -> EngineLink:
    where = f"{plan.key} ({plan.model}): cannot open its ring region {plan.region!r}"
    try:
        transport = ShmTransport.open(plan.region)
    except (OSError, ValueError) as e:  # missing (engine not up), not a blink region, in use
        raise ProfileError(f"{where}: {e}") from None
    try:
        client = EngineClient.attach(transport, plan.geometry, **limits)
    except (OSError, ValueError) as e:  # a region laid out for another geometry (another profile)
        transport.close()
        raise ProfileError(f"{where}: {e}") from None
    return EngineLink(plan, transport, client)


async def detach_engines(links: EngineLinks) -> None:
    """Close every client (cancelling what is still open) and then its region."""
    if links.supervisor is not None:
        links.supervisor.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await links.supervisor
    for link in links:
        await link.client.close()
        if link.transport is not None:
            link.transport.close()
    if links.remote is not None:
        links.remote.close()
