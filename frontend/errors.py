"""API errors in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}`."""

from __future__ import annotations

from typing import Any

from aiohttp import web


class APIError(Exception):
    """An error the client should see, with its HTTP status and OpenAI error fields."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> web.Response:
        return web.json_response(self.body(), status=self.status, headers=self.headers)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def not_supported(param: str, what: str | None = None) -> APIError:
    return APIError(
        400,
        f"'{param}' is not supported yet{f' ({what})' if what else ''}",
        param=param,
        code="unsupported_parameter",
    )


def service_unavailable(message: str, *, retry_after_s: int | None = None) -> APIError:
    headers = {"Retry-After": str(retry_after_s)} if retry_after_s is not None else None
    return APIError(503, message, type="server_error", code="service_unavailable", headers=headers)
