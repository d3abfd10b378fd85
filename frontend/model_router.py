"""The models one front end serves: a request goes to the CompletionService of the model it names.

Each model has its own engine, ring region and service; the router only picks one by name and
answers for all of them together (drain, in-flight count, liveness, the shared metrics registry).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from dataclasses import dataclass

from blink_appliance.frontend.completion_service import CompletionService
from blink_appliance.frontend.errors import APIError
from blink_appliance.frontend.metrics import MetricsRegistry


@dataclass(frozen=True)
class ModelHealth:
    name: str
    status: str  # "ok" | "engine_unavailable" | "draining"
    inflight: int


class ModelRouter:
    def __init__(self, services: Iterable[CompletionService]) -> None:
        self._services: dict[str, CompletionService] = {}
        for service in services:
            name = service.limits.model_name
            if name in self._services:  # a second service under one name could never be reached
                raise ValueError(f"two services for model {name!r}")
            self._services[name] = service
        registries = {id(s.metrics.families): s.metrics.families for s in self._services.values()}
        if len(registries) > 1:  # /metrics renders one registry: every model's series must be in it
            raise ValueError("every model's ServingMetrics must share one MetricsRegistry")
        self.metrics = next(iter(registries.values())) if registries else MetricsRegistry()

    @property
    def names(self) -> list[str]:
        return list(self._services)

    @property
    def services(self) -> list[CompletionService]:
        return list(self._services.values())

    def service_for(self, model: str) -> CompletionService:
        """The service of `model`, or OpenAI's 404 for a model this appliance does not serve."""
        service = self._services.get(model)
        if service is None:
            served = ", ".join(f"'{name}'" for name in self._services) or "no model"
            raise APIError(
                404,
                f"the model '{model}' does not exist; this appliance serves {served}",
                param="model",
                code="model_not_found",
            )
        return service

    @property
    def draining(self) -> bool:
        return any(s.draining for s in self._services.values())

    @draining.setter
    def draining(self, value: bool) -> None:
        for service in self._services.values():
            service.draining = value

    @property
    def inflight(self) -> int:
        return sum(s.inflight for s in self._services.values())

    async def wait_idle(self) -> None:
        await asyncio.gather(*(s.wait_idle() for s in self._services.values()))

    def health(self) -> list[ModelHealth]:
        """Each model's state, in the order the profile lists them."""
        return [
            ModelHealth(
                name,
                "draining" if s.draining else "ok" if s.client.engine_alive else "engine_unavailable",
                s.inflight,
            )
            for name, s in self._services.items()
        ]
