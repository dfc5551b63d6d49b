"""Errors in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}` with the HTTP status."""

from __future__ import annotations


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

    def body(self) -> dict:
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
