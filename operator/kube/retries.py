"""API calls of a run (a PrefixCacheReset, a WeightUpdate, a catch-up pass) that retry what may pass and end
the run, with a reason, on what will not."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

from kvpilot.fanout.backoff import backoff_delay
from kvpilot.operator.kube.api import ApiException, is_transient

_API_REASONS = {400: "InvalidRequest", 401: "Unauthorized", 403: "Forbidden", 404: "NotFound", 422: "Invalid"}
_BACKOFF_BASE_S, _BACKOFF_MAX_S = 0.2, 5.0
_T = TypeVar("_T")


class RunFailure(Exception):
    """The run cannot go on: it ends Failed with this reason."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason, self.message = reason, message


def _api_message(exc: ApiException) -> str:
    try:
        return json.loads(exc.body or "{}").get("message") or str(exc.reason)
    except (ValueError, AttributeError):
        return str(exc.reason)


async def with_retries(
    what: str, call: Callable[[], Awaitable[_T]], deadline: float, also: tuple[int, ...] = ()
) -> _T:
    """`call()`, retried with backoff on transient API errors (and on the statuses in `also`) until the
    deadline; any other API error (4xx) ends the run with a specific reason."""
    n = 0
    while True:
        try:
            return await call()
        except ApiException as exc:
            if not is_transient(exc) and exc.status not in also:
                raise RunFailure(
                    _API_REASONS.get(exc.status, "ApiError"),
                    f"{what}: HTTP {exc.status}: {_api_message(exc)}",
                ) from exc
            last: BaseException = exc
        except Exception as exc:
            if not is_transient(exc):
                raise
            last = exc
        n += 1
        delay = backoff_delay(n, _BACKOFF_BASE_S, _BACKOFF_MAX_S)
        if time.monotonic() + delay >= deadline:
            raise RunFailure("ApiUnavailable", f"{what}: {last} (tried {n} times until timeoutSeconds)")
        await asyncio.sleep(delay)
