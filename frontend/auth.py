"""Optional bearer API keys: with keys configured, /v1/* and /telemetry* need `Authorization: Bearer <key>`.

/health and /metrics stay open so load balancers and Prometheus need no secret (they reveal no
request content).
"""

from __future__ import annotations

import hmac
import os
from collections.abc import Awaitable, Callable, Iterable

from aiohttp import web
from blink_appliance.frontend.errors import APIError

API_KEY_ENV = "BLINK_API_KEY"
_PROTECTED_PREFIXES = ("/v1/", "/telemetry")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def configured_keys(profile_keys: Iterable[str], environ: dict[str, str] | None = None) -> tuple[str, ...]:
    """The profile's keys plus BLINK_API_KEY when set (empty: authentication off)."""
    env = os.environ if environ is None else environ
    keys = [k for k in profile_keys if k]
    if env.get(API_KEY_ENV):
        keys.append(env[API_KEY_ENV])
    return tuple(keys)


def bearer_auth_middleware(keys: tuple[str, ...]):
    encoded = [k.encode() for k in keys]

    def valid(token: str) -> bool:
        t = token.encode()
        # Compare against every key without stopping early, so timing says nothing about which.
        return any([hmac.compare_digest(t, k) for k in encoded])

    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        if encoded and request.path.startswith(_PROTECTED_PREFIXES):
            scheme, _, token = request.headers.get("Authorization", "").partition(" ")
            if scheme.lower() != "bearer" or not valid(token.strip()):
                raise APIError(
                    401,
                    "missing or invalid API key: send 'Authorization: Bearer <key>'",
                    code="invalid_api_key",
                    headers={"WWW-Authenticate": "Bearer"},
                )
        return await handler(request)

    return middleware
