"""The front end's link to each model's engine: the model's ring region (shared memory the daemon
created) and a started EngineClient on it. Start-up needs every one: a region that cannot be
opened ends it with a ProfileError naming the model and the region, and the links made before it
are closed again."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from blink_appliance.profile import ProfileError
from blink_appliance.wire.client import EngineClient
from blink_appliance.wire.ring_layout import RingGeometry
from blink_appliance.wire.shm_transport import ShmTransport


@dataclass(frozen=True)
class RegionPlan:
    """Where model `model`'s engine listens: the shm name of its region and its ring geometry."""

    model: str
    region: str
    geometry: RingGeometry


@dataclass
class EngineLink:
    plan: RegionPlan
    transport: ShmTransport
    client: EngineClient

    @property
    def model(self) -> str:
        return self.plan.model


async def attach_engines(plans: Iterable[RegionPlan], *, request_timeout_s: float) -> list[EngineLink]:
    """One started EngineClient per region, in the order given."""
    links: list[EngineLink] = []
    try:
        for i, plan in enumerate(plans):
            links.append(_open(i, plan, request_timeout_s))
            await links[-1].client.start()
    except BaseException:
        await detach_engines(links)
        raise
    return links


def _open(index: int, plan: RegionPlan, request_timeout_s: float) -> EngineLink:
    where = f"models[{index}] ({plan.model}): cannot open its ring region {plan.region!r}"
    try:
        transport = ShmTransport.open(plan.region)
    except (OSError, ValueError) as e:  # missing (engine not up), not a blink region, in use
        raise ProfileError(f"{where}: {e}") from None
    try:
        client = EngineClient.attach(transport, plan.geometry, request_timeout_s=request_timeout_s)
    except (OSError, ValueError) as e:  # a region laid out for another geometry (another profile)
        transport.close()
        raise ProfileError(f"{where}: {e}") from None
    return EngineLink(plan, transport, client)


async def detach_engines(links: Iterable[EngineLink]) -> None:
    """Close every client (cancelling what is still open) and then its region."""
    for link in links:
        await link.client.close()
        link.transport.close()
