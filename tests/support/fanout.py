"""The fan-out's HTTP/1.1 pool as the tests watch it: how many connections it opened, to see keep-alive
reuse."""

from __future__ import annotations

from kvpilot.fanout.http1 import Endpoint, Pool, _Connection


class CountingPool(Pool):
    """A Pool that counts the connections it opens."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.opened = 0

    async def _connect(self, ep: Endpoint) -> _Connection:
        conn = await super()._connect(ep)
        self.opened += 1
        return conn
