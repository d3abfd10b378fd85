"""Optional bearer API keys: with keys configured, /v1/*, /telemetry*, /tokenize and /detokenize need
`Authorization: Bearer <key>`.

/health and /metrics stay open so load balancers and Prometheus need no secret (they reveal no
request content). A key may carry a priority class (`[frontend] api_keys` tables): the middleware
leaves the class of the key a request came with under `request[KEY_PRIORITY]` (None: no class), and
the completion service turns it into the request's priority (prepared.effective_priority).
"""

from __future__ import annotations

import hmac
import os
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import Protocol

from aiohttp import web
from blink_appliance.frontend.errors import APIError

API_KEY_ENV = "BLINK_API_KEY"
_PROTECTED_PREFIXES = ("/v1/", "/telemetry", "/tokenize", "/detokenize")
# Where the middleware leaves the matched key's class (int or None) on the aiohttp request.
KEY_PRIORITY = "blink.key_priority"

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@dataclass(frozen=True)
class BearerKey:
    key: str
    priority: int | None = None  # the class of this key's requests; None: the model's default


class _KeyEntry(Protocol):  # the profile's ApiKey
    key: str
    priority: int | None


def configured_keys(
    profile_keys: Iterable[str | _KeyEntry], environ: dict[str, str] | None = None
) -> tuple[BearerKey, ...]:
    """The profile's keys (with their classes) plus BLINK_API_KEY when set, without a class (empty:
    authentication off). A profile key equal to BLINK_API_KEY keeps its class: it comes first."""
    env = os.environ if environ is None else environ
    keys = [_bearer(k) for k in profile_keys]
    keys = [k for k in keys if k.key]
    if env.get(API_KEY_ENV):
        keys.append(BearerKey(env[API_KEY_ENV]))
    return tuple(keys)


def _bearer(entry: str | BearerKey | _KeyEntry) -> BearerKey:
    if isinstance(entry, str):
        return BearerKey(entry)
    if isinstance(entry, BearerKey):
        return entry
    return BearerKey(entry.key, entry.priority)


def bearer_auth_middleware(keys: Iterable[str | BearerKey]):
    entries = [_bearer(k) for k in keys]
    encoded = [k.key.encode() for k in entries]

    def matched(token: str) -> BearerKey | None:
        t = token.encode()
        # Compare against every key without stopping early, so timing says nothing about which.
        hits = [hmac.compare_digest(t, k) for k in encoded]
        return next((entries[i] for i, hit in enumerate(hits) if hit), None)

    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        if encoded and request.path.startswith(_PROTECTED_PREFIXES):
            scheme, _, token = request.headers.get("Authorization", "").partition(" ")
            key = matched(token.strip()) if scheme.lower() == "bearer" else None
            if key is None:
                raise APIError(
                    401,
                    "missing or invalid API key: send 'Authorization: Bearer <key>'",
                    code="invalid_api_key",
                    headers={"WWW-Authenticate": "Bearer"},
                )
            request[KEY_PRIORITY] = key.priority
        return await handler(request)

    return middleware
