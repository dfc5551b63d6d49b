"""Errors in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}` with the HTTP status, and
the error middleware the daemon and the router share: whatever a handler raises, the client gets that
shape, never aiohttp's plain-text 500 with a stack trace in the log only."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

from aiohttp import web
from aiohttp.typedefs import Middleware

from kvpilot.protocol import JSONObject
from kvpilot.protocol.replies import json_response

log = logging.getLogger(__name__)


class ApiError(Exception):
    """An error to answer with `{"error": {"message", "type", "param", "code"}}`."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        type_: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.type = type_ or _default_type(status)
        self.code = code
        self.headers = headers or {}

    def body(self) -> JSONObject:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def _default_type(status: int) -> str:
    if status == 401:
        return "authentication_error"
    if status == 404:
        return "not_found_error"
    if status == 503:
        return "service_unavailable_error"
    if status >= 500:
        return "server_error"
    return "invalid_request_error"


def bad(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param, code=code)


RETRY_AFTER_SECONDS = 1


def unavailable(message: str, code: str) -> ApiError:
    """Overloaded for now: 503 with Retry-After, so clients back off and come back."""
    return ApiError(503, message, code=code, headers={"Retry-After": str(RETRY_AFTER_SECONDS)})


def error_response(err: ApiError, extra: JSONObject | None = None) -> web.Response:
    """`err` as a reply; `extra` adds fields beside "error" (a reset's per-rank results)."""
    return json_response({**(extra or {}), **err.body()}, status=err.status, headers=err.headers)


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def error_middleware(max_body_bytes: int) -> Middleware:
    """The outermost middleware of an application whose bodies may hold `max_body_bytes`."""

    @web.middleware
    async def answer_errors(request: web.Request, handler: Handler) -> web.StreamResponse:
        try:
            return await handler(request)
        except ApiError as err:
            return error_response(err)
        except web.HTTPRequestEntityTooLarge:
            msg = f"the request body exceeds {max_body_bytes} bytes"
            return error_response(ApiError(413, msg, code="request_too_large"))
        except web.HTTPException as exc:  # aiohttp's own: unknown route (404), wrong method (405)
            if exc.status < 400:
                raise
            return error_response(_http_error(request, exc))
        except RecursionError:
            # Only a client's input nests deep enough (JSON arrays in arrays, parsed or walked).
            return error_response(bad("the request body is nested too deeply", code="nested_too_deeply"))
        except ConnectionResetError:  # the client left: nobody to answer
            raise
        except Exception:
            log.exception("unhandled error on %s %s", request.method, request.path)
            return error_response(ApiError(500, "internal server error", code="internal_error"))

    return answer_errors


def _http_error(request: web.Request, exc: web.HTTPException) -> ApiError:
    if isinstance(exc, web.HTTPNotFound):
        return ApiError(404, f"no route {request.path}", code="not_found")
    if isinstance(exc, web.HTTPMethodNotAllowed):
        allowed = ", ".join(sorted(exc.allowed_methods))
        return ApiError(
            405,
            f"{request.method} is not allowed on {request.path} (allowed: {allowed})",
            code="method_not_allowed",
            headers={"Allow": allowed},
        )
    return ApiError(exc.status, exc.reason or "error")
