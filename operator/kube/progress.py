"""A run's status writes for people, and kopf's stop flag as an asyncio.Event: what a PrefixCacheReset and a
PrefixCacheWarmup both need while their fan-out runs (resets/drive.py, warmups/drive.py)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any


class Progress:
    """The status writes for people (Pending at first sight, Running, each checkpoint): best effort, in
    order (each waits for the one before), and none holds up what it reports (the list, the calls), so a
    run's first calls leave while its Running status is on its way. A write is never cancelled halfway
    (its request would still land, maybe after the final status): `settle` waits for them all."""

    def __init__(
        self,
        patch: Callable[[Mapping[str, Any]], Awaitable[object]],
        what: str,
        logger: logging.Logger | logging.LoggerAdapter[Any],
    ) -> None:
        """`patch(status)`: one status write of the run; `what` names the run in a warning."""
        self.patch, self.what, self.logger = patch, what, logger
        self._last: asyncio.Task[None] | None = None

    def write(self, status: Mapping[str, Any], label: str) -> asyncio.Task[None]:
        before = self._last

        async def go() -> None:
            if before is not None:
                await asyncio.wait([before])
            try:
                await self.patch(status)
            except Exception as exc:  # noqa: BLE001 - for people only
                self.logger.warning("%s: %s not written: %s", self.what, label, exc)

        self._last = asyncio.create_task(go())
        return self._last

    async def settle(self) -> None:
        """Wait for the writes started so far: the next write must land after them."""
        if self._last is not None:
            await asyncio.wait([self._last])


@contextlib.asynccontextmanager
async def stop_flag(stopped: Any) -> AsyncIterator[asyncio.Event]:
    """An asyncio.Event set when kopf's `stopped` flag is (the operator stops), for the fan-out's `stop`."""
    stop = asyncio.Event()

    async def bridge() -> None:
        if stopped is not None:
            await stopped.wait()
            stop.set()

    bridging = asyncio.create_task(bridge())
    try:
        yield stop
    finally:
        bridging.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await bridging
