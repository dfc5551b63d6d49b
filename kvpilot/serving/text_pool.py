"""The server's text work (JSON parsing, chat templating, tokenizing, detokenizing) off the event loop.

A 4 MiB prompt takes seconds to tokenize; on the event loop it would stall health checks, metrics
scrapes and every stream for that long. Jobs run in a small thread pool instead (the Rust tokenizer
releases the GIL while it works). At most `max_pending` request-preparation jobs may wait for it; more
are refused (503) rather than queued without bound.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


class Busy(RuntimeError):
    """Too many requests are waiting to be tokenized."""


class TextPool:
    def __init__(self, workers: int = 2, max_pending: int = 64) -> None:
        self._pool = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="kvpilot-text")
        self._max_pending = max_pending
        self._pending = 0

    async def prepare(self, fn: Callable[..., T], *args: Any) -> T:
        """A request's preparation (parse, template, tokenize); Busy when too many wait."""
        if self._pending >= self._max_pending:
            raise Busy(f"{self._max_pending} requests are already waiting to be tokenized")
        self._pending += 1
        try:
            return await self.run(fn, *args)
        finally:
            self._pending -= 1

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._pool, functools.partial(fn, *args))

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
