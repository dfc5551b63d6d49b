"""What every kvpilot HTTP server (`kvpilot serve`, `kvpilot router`) allows a client's connection.

Two limits, applied where connections are accepted, before aiohttp parses a byte:

- Header timeout. A connection must deliver a complete request header within `header_timeout`
  seconds of opening; one that does not (slowloris: a header sent a byte at a time, or never finished)
  gets a 408 and is closed. aiohttp's keep-alive timeout is set to the same value, which covers the
  later requests of a kept-alive connection: aiohttp closes a connection that has no request in progress
  and no complete header that long after its last reply. So an idle kept-alive connection is closed
  then too; kvpilot's own clients (the router's pool to its pods) keep idle connections for
  `UPSTREAM_IDLE_S`, less than that, so they never send on a connection the server is closing.
- Connection cap. At most `max_connections` connections are open at once; a new one beyond that is
  answered 503 (with Retry-After) and closed at once, so a flood costs the server nothing but the
  accept, and the header timeout frees the slots slow clients hold.

Both answers are OpenAI error JSON, like every other error of these servers.

Why aiohttp's server is wrapped in a protocol of its own, and what of aiohttp that leans on, in
this module only. Not for speed: for what aiohttp's public API lacks. aiohttp 3.14.5 has no connection cap
and no header timeout that answers (its keep-alive timer, armed at connect, drops a connection whose header
never completes without a word), and the limits must act before aiohttp parses a byte. So each accepted
connection gets a `_Guarded` that hands every event on to the protocol `AppRunner.server` makes (aiohttp's
`web_protocol.RequestHandler`): one more Python call per event, never measured apart from a request's
cost. What it buys is measured in tests/router/test_client_limits.py: 100 slowloris connections answered
408 at the timeout while /health answers, and a connection past the cap answered 503 at once. It leans on:
- `RequestHandler` being a plain `asyncio.Protocol` whose callbacks are the six `_Guarded` passes on
  (`connection_made`, `data_received`, `eof_received`, `pause_writing`, `resume_writing`,
  `connection_lost`): as a `BufferedProtocol` (`get_buffer`, `buffer_updated`) it would get no bytes;
- aiohttp never asking the transport for its protocol (`get_protocol`, `set_protocol`): it would find the
  gate, not itself;
- `RequestHandler.connection_made` registering the connection with its `web.Server`, so that
  `runner.cleanup()` still ends the connections handed to it;
- its keep-alive timer (`keepalive_timeout`) closing a kept-alive connection whose next header has not
  come, which is the header timeout of every request but a connection's first.
Verified on aiohttp 3.14.5 (asyncio and uvloop 0.23.0, CPython 3.11). The guard,
tests/test_framework_guards.py (`test_http_limits_*`), fails on a version that changes any of these,
naming it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import resource
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, cast

from kvpilot.cli.flags import flag

if TYPE_CHECKING:
    from aiohttp import web

log = logging.getLogger(__name__)

# How long kvpilot's HTTP clients keep an idle connection to a kvpilot server for reuse: below the
# servers' least sensible header timeout, so a reused connection is never one the server is closing.
UPSTREAM_IDLE_S = 4.0
_FDS_PER_CONNECTION = 2  # the router holds a pod connection for each client connection
_FDS_SPARE = 256  # the engine's, ZeroMQ's, logs', the listening socket's


@dataclass(frozen=True, slots=True)
class ConnectionLimits:
    header_timeout: float = field(
        default=10.0,
        metadata=flag(
            "seconds a connection may take to send a complete request header (from opening, or from its "
            "last reply); slower ones get 408 and are closed, and so are connections idle that long"
        ),
    )
    max_connections: int = field(
        default=1024,
        metadata=flag("open connections at most; a new one beyond that is answered 503 and closed"),
    )

    def validate(self) -> None:
        if not self.header_timeout > UPSTREAM_IDLE_S:
            raise ValueError(f"header_timeout must be more than {UPSTREAM_IDLE_S:g} seconds")
        if self.max_connections < 1:
            raise ValueError("max_connections must be positive")


@dataclass(slots=True)
class _Gate:
    """The listener's shared count of open connections, and what its guards answer."""

    limits: ConnectionLimits
    make_handler: Callable[[], asyncio.Protocol]  # aiohttp's protocol factory (the runner's server)
    timeout_reply: bytes
    full_reply: bytes
    open: int = 0


class _Guarded(asyncio.Protocol):
    """One accepted connection: counted, timed until its first header is complete, and otherwise handed
    unchanged to aiohttp's protocol."""

    def __init__(self, gate: _Gate) -> None:
        self._gate = gate
        self._inner: asyncio.Protocol | None = None
        self._transport: asyncio.Transport | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._tail = b""  # the last bytes seen, for a header end split across two reads

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        gate = self._gate
        transport = cast(asyncio.Transport, transport)  # uvloop's is one without subclassing it
        if gate.open >= gate.limits.max_connections:
            transport.write(gate.full_reply)
            transport.close()
            return
        gate.open += 1
        self._transport = transport
        loop = asyncio.get_running_loop()
        self._timer = loop.call_later(gate.limits.header_timeout, self._header_timed_out)
        self._inner = gate.make_handler()
        self._inner.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        if self._inner is None:
            return
        if self._timer is not None:
            # A header ends with an empty line; aiohttp's parser accepts bare LF line ends too.
            seen = self._tail + data
            if b"\n\n" in seen or b"\n\r\n" in seen:
                self._timer.cancel()
                self._timer = None
            self._tail = seen[-2:]
        self._inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self._inner.eof_received() if self._inner is not None else None

    def pause_writing(self) -> None:
        if self._inner is not None:
            self._inner.pause_writing()

    def resume_writing(self) -> None:
        if self._inner is not None:
            self._inner.resume_writing()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._inner is not None:
            self._gate.open -= 1
            inner, self._inner = self._inner, None
            inner.connection_lost(exc)

    def _header_timed_out(self) -> None:
        self._timer = None
        if self._transport is not None and not self._transport.is_closing():
            self._transport.write(self._gate.timeout_reply)
            self._transport.close()


def _reply(status: int, reason: str, message: str, code: str, extra: str = "") -> bytes:
    """A complete HTTP/1.1 reply with OpenAI's error JSON, for a connection no handler will serve."""
    from kvpilot.protocol.errors import ApiError

    body = (json.dumps(ApiError(status, message, code=code).body()) + "\n").encode()
    head = (
        f"HTTP/1.1 {status} {reason}\r\nContent-Type: application/json; charset=utf-8\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n{extra}\r\n"
    )
    return head.encode("ascii") + body


def _raise_fd_limit(max_connections: int) -> None:
    """Room for every allowed connection: a soft file limit below it would fail accepts first."""
    want = max_connections * _FDS_PER_CONNECTION + _FDS_SPARE
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < want:
        new = want if hard == resource.RLIM_INFINITY else min(want, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))
        if new < want:
            log.warning(
                "open files limited to %d: fewer than the %d that --max-connections %d may need",
                new,
                want,
                max_connections,
            )


class Served:
    """An aiohttp application served on a listening socket with the connection limits."""

    def __init__(self, runner: web.AppRunner, server: asyncio.Server) -> None:
        self.runner = runner
        self._server = server

    @property
    def port(self) -> int:
        port: int = self._server.sockets[0].getsockname()[1]  # an IP socket's name: (host, port, ...)
        return port

    def stop_listening(self) -> None:
        """No new connections; open ones finish their current request."""
        self._server.close()

    async def cleanup(self) -> None:
        """Stop listening, end the open connections (within the runner's shutdown timeout), run the
        application's cleanup."""
        self._server.close()
        await self.runner.cleanup()


async def start_server(
    app: web.Application, host: str, port: int, limits: ConnectionLimits, shutdown_timeout: float = 5.0
) -> Served:
    """Serve `app` on host:port with `limits`; returns once listening."""
    from aiohttp import web

    limits.validate()
    # handler_cancellation: a client that disconnects cancels its handler at once (the daemon aborts the
    # engine request, the router its upstream one).
    runner = web.AppRunner(
        app,
        handler_cancellation=True,
        access_log=None,
        shutdown_timeout=shutdown_timeout,
        keepalive_timeout=limits.header_timeout,
    )
    await runner.setup()
    _raise_fd_limit(limits.max_connections)
    timeout = f"no complete request header within {limits.header_timeout:g} s"
    full = f"the server has {limits.max_connections} connections open; try again"
    assert runner.server is not None  # made by setup()
    gate = _Gate(
        limits,
        runner.server,
        _reply(408, "Request Timeout", timeout, "header_timeout"),
        _reply(503, "Service Unavailable", full, "too_many_connections", "Retry-After: 1\r\n"),
    )
    loop = asyncio.get_running_loop()
    try:
        server = await loop.create_server(lambda: _Guarded(gate), host, port, reuse_address=True, backlog=128)
    except BaseException:
        await runner.cleanup()
        raise
    return Served(runner, server)
