"""The front end's aiohttp application: routes, error shaping, auth, body limit."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from importlib.metadata import version as package_version

from aiohttp import web
from blink_appliance.frontend import handlers
from blink_appliance.frontend.auth import bearer_auth_middleware
from blink_appliance.frontend.completion_service import CompletionService
from blink_appliance.frontend.errors import APIError
from blink_appliance.frontend.model_router import ModelRouter
from blink_appliance.frontend.openai_schema import now_s
from blink_appliance.frontend.tokenize_routes import add_tokenize_routes

from blink_appliance.telemetry.source import TelemetrySource

log = logging.getLogger(__name__)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

_STATUS_TYPES = {401: "invalid_request_error", 404: "not_found_error", 405: "invalid_request_error"}


@web.middleware
async def openai_errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Every error leaves in OpenAI's error body, whatever raised it."""
    try:
        return await handler(request)
    except APIError as e:
        return e.response()
    except web.HTTPRequestEntityTooLarge as e:
        return APIError(413, f"the request body is too large ({e.text})", code="request_too_large").response()
    except web.HTTPException as e:
        if e.status < 400:
            raise
        kind = _STATUS_TYPES.get(e.status, "invalid_request_error" if e.status < 500 else "server_error")
        message = (
            f"{e.reason}: {request.method} {request.path}" if e.status in (404, 405) else (e.text or e.reason)
        )
        headers = {k: v for k, v in e.headers.items() if k.lower() == "allow"}
        return APIError(e.status, message, type=kind, headers=headers).response()
    except Exception:
        log.exception("unhandled error in %s %s", request.method, request.path)
        return APIError(500, "internal error in the front end", type="server_error").response()


_VERSION = package_version("blink-appliance")


async def version(request: web.Request) -> web.Response:
    """vLLM's /version. Open without an API key, like /health: it names no model and no request."""
    return web.json_response({"version": _VERSION})


def create_app(
    services: CompletionService | ModelRouter,
    *,
    api_keys: tuple[str, ...] = (),
    max_request_bytes: int = 1 << 20,
    body_timeout_s: float = 30.0,
    telemetry: TelemetrySource | None = None,
) -> web.Application:
    app = web.Application(
        middlewares=[openai_errors, bearer_auth_middleware(api_keys)], client_max_size=max_request_bytes
    )
    # One service is one model; a ModelRouter routes each request to the model it names.
    app[handlers.MODELS] = services if isinstance(services, ModelRouter) else ModelRouter([services])
    app[handlers.STARTED_AT] = now_s()
    app[handlers.BODY_TIMEOUT_S] = body_timeout_s
    app.router.add_post("/v1/completions", handlers.completions)
    app.router.add_post("/v1/chat/completions", handlers.chat_completions)
    app.router.add_get("/v1/models", handlers.list_models)
    app.router.add_get("/v1/models/{model}", handlers.get_model)
    app.router.add_get("/health", handlers.health)
    app.router.add_get("/version", version)
    app.router.add_get("/metrics", handlers.metrics)
    add_tokenize_routes(app)
    if telemetry is not None:
        from blink_appliance.frontend.telemetry_routes import add_telemetry_routes

        add_telemetry_routes(app, telemetry)
    return app


def runner_for(app: web.Application, *, header_timeout_s: float) -> web.AppRunner:
    """The runner the front end serves `app` with. handler_cancellation: a client that disconnects
    cancels its handler, hence its request. keepalive_timeout is aiohttp's timer from a connection's
    start (and from each response's end) to its next whole request head: a client that trickles its
    head, or idles, is closed at it. lingering_time: after an early reply (a 408, a 413) the rest of
    a body is read for 2 s, not aiohttp's 10, so a trickling client lets go soon after its 408."""
    return web.AppRunner(
        app, handler_cancellation=True, access_log=None, shutdown_timeout=5.0,
        keepalive_timeout=header_timeout_s, lingering_time=2.0,
    )  # fmt: skip
