"""The fan-out's HTTP/1.1 client: one small request per call (a reset, or a canary's JSON body), keep-alive
per pod, replies read up to a bound. The router sends its non-streamed generation requests through it too
(router/proxy.py, `Pool.call`: the reply's headers, a bound of its own, a silence timer).

Why not aiohttp's ClientSession: a reset call is a few hundred bytes each way, and aiohttp's per-request
machinery (URL and header objects, the timer, the connector's bookkeeping, happy eyeballs) cost ~380 µs of
CPU a call against ~150 µs here, kernel included (docs/fanout.md, "What bounds it"). With this client (and
the pod list decoded once, in the same change) the operator's CPU a pod fell from 0.52 to 0.19 ms, and 5,000
pods that answer at once were reset in 1.31 s (0.60x a sequential loop's time) instead of 4.58 s (1.74x)
(bench/fanout.py, docs/performance.md, "Fan-out"): far more than the 10% within which aiohttp's public
client would replace it. Only what a reset call needs is here: a request prepared once per target, a status
line, the headers that frame the body (Content-Length, chunked, or to the end of the connection), and the
body, read up to `MAX_REPLY_BYTES`.

Connections are kept alive per pod, never per address alone: a `Pool` files each connection under the
target's identity (its pod uid, or its name) and address, so a connection opened to one pod never carries
a request, and its admin token, meant for another pod that has since taken the same IP.

It touches no library's private parts, only asyncio's public `Protocol` and `create_connection` (uvloop's
in the operator). What a library upgrade could break is what it reads: the HTTP/1.1 replies of the servers it
calls (kvpilot's daemons are aiohttp's server). Verified against aiohttp 3.14.5's server (asyncio and uvloop
0.23.0, CPython 3.11): tests/test_framework_guards.py (`test_http1_*`) fails, naming aiohttp's version, on one
whose replies it no longer reads or keeps alive.
"""

from __future__ import annotations

import asyncio
import re
import ssl as ssl_module
import time
from collections import OrderedDict
from dataclasses import dataclass

from kvpilot.fanout.redact import MAX_REPLY_BYTES  # past it the rest is not read, the connection closed

_HEX = re.compile(rb"[0-9A-Fa-f]{1,16}")
MAX_HEAD_BYTES = 16 * 1024  # status line and headers; a longer head is a broken reply
IDLE_S = 4.0  # how long an idle connection is reused: under uvicorn's 5 s keep-alive (vLLM, SGLang)


@dataclass(slots=True)
class Reply:
    status: int
    body: bytes  # at most the call's bound
    headers: dict[str, str]  # by lower-case name (the last of a repeated one)
    complete: bool  # False: the body ran past the bound and was cut there (the connection closed)


class ReplyError(Exception):
    """The connection broke, or what came back is not an HTTP/1.x reply."""

    def __init__(self, message: str, replied: bool = False) -> None:
        super().__init__(message)
        self.replied = replied  # some of a reply had arrived: the request was surely received


@dataclass(frozen=True, slots=True)
class Endpoint:
    """Where one target's reset goes, and the request bytes, prepared once per target."""

    key: tuple[str, str, int, bool]  # (identity, host, port, tls): connections are kept per key
    host: str
    port: int
    tls: bool
    request: bytes


def header_value_ok(value: str) -> bool:
    """A header value that cannot break the request apart: printable, no CR, LF or NUL."""
    return value.isprintable() and value.isascii()


def endpoint(
    identity: str,
    host: str,
    port: int,
    tls: bool,
    path: str,
    method: str,
    token: str | None,
    json_body: bytes = b"",
    headers: tuple[str, ...] = (),
) -> Endpoint:
    """The endpoint of one target (`identity`: its pod uid or name); the token must be `header_value_ok`.
    `json_body`: a JSON request body (a verification canary); `headers`: more "Name: value" lines."""
    netloc = f"[{host}]" if ":" in host else host  # IPv6
    head = [
        f"{method} {path} HTTP/1.1",
        f"Host: {netloc}:{port}",
        "User-Agent: kvpilot-fanout",
        f"Content-Length: {len(json_body)}",
        *(["Content-Type: application/json"] if json_body else []),
        *headers,
    ]
    if token:
        head.append(f"Authorization: Bearer {token}")
    request = ("\r\n".join(head) + "\r\n\r\n").encode("ascii") + json_body
    return Endpoint((identity, host, port, tls), host, port, tls, request)


class _Connection(asyncio.Protocol):
    """One TCP (or TLS) connection: a request at a time, its reply parsed as the bytes come."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.idle_since = 0.0
        self._buf = bytearray()
        self._reply: asyncio.Future[tuple[Reply, bool]] | None = None
        self._status = 0
        self._headers: dict[str, str] = {}
        self._max_body = MAX_REPLY_BYTES
        self._silence_s: float | None = None
        self._last_data = 0.0
        self._timer: asyncio.TimerHandle | None = None
        self._loop = asyncio.get_running_loop()  # (made by create_connection, on its loop)
        self._keep = True
        self._mode = ""  # "" (reading the head), "length", "chunked" or "close"
        self._left = 0  # length: body bytes still to come
        self._body = bytearray()
        self._chunk = -1  # chunked: data bytes left in the chunk (-1: at a size line, -2: at its CRLF)

    # -- asyncio.Protocol --------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # A stream connection's transport is an asyncio.Transport; asyncio.Protocol's signature names the base.
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        if self._reply is None or self._reply.done():
            self._abort()  # bytes nobody asked for: this connection cannot be trusted to frame a reply
            return
        self._buf += data
        if self._timer is not None:
            self._last_data = self._loop.time()
        try:
            self._parse()
        except ReplyError as exc:
            self._fail(exc)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self._reply is None or self._reply.done():
            return
        if self._mode == "close" and exc is None:  # a body that runs to the end of the connection has ended
            self._done(keep=False)
            return
        why = f": {exc}" if exc else ""
        self._fail(
            ReplyError(f"connection closed before a full reply{why}", replied=bool(self._buf or self._mode))
        )

    # -- one exchange --------------------------------------------------------------------------------
    def send(
        self, request: bytes, max_body: int = MAX_REPLY_BYTES, silence_s: float | None = None
    ) -> asyncio.Future[tuple[Reply, bool]]:
        """Write the request; the future gives (the reply, its body up to `max_body`; reusable), or raises
        TimeoutError once the server has sent nothing for `silence_s` (None: the caller bounds the time)."""
        assert self.transport is not None
        loop = self._loop
        self._reply = loop.create_future()
        self._buf.clear()
        self._body = bytearray()
        self._headers = {}
        self._status, self._keep, self._mode, self._chunk = 0, True, "", -1
        self._max_body, self._silence_s = max_body, silence_s
        if silence_s is not None:
            self._last_data = loop.time()
            self._timer = loop.call_at(self._last_data + silence_s, self._check_silence)
        self.transport.write(request)
        return self._reply

    def _check_silence(self) -> None:
        """The silence timer: fail the call if nothing came for `silence_s`, else look again when it could
        have (one timer a call, moved only when it fires, not rearmed on every read)."""
        assert self._silence_s is not None
        loop = self._loop
        due = self._last_data + self._silence_s
        if loop.time() < due:
            self._timer = loop.call_at(due, self._check_silence)
            return
        self._timer = None
        self._abort()
        if self._reply is not None and not self._reply.done():
            self._reply.set_exception(TimeoutError(f"nothing for {self._silence_s:g} s"))

    def _stop_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def close(self) -> None:
        self.closed = True
        self._stop_timer()
        if self.transport is not None:
            self.transport.close()

    def _abort(self) -> None:
        self.closed = True
        self._stop_timer()
        if self.transport is not None:
            self.transport.abort()

    def _fail(self, exc: ReplyError) -> None:
        self._abort()
        if self._reply is not None and not self._reply.done():
            self._reply.set_exception(exc)

    def _done(self, keep: bool, complete: bool = True) -> None:
        self._stop_timer()
        # Not reused with bytes past the reply, nor with some of the request still unsent (the server
        # answered early: the rest would reach it as the start of the next request).
        unsent = self.transport is not None and self.transport.get_write_buffer_size() > 0
        keep = keep and complete and self._keep and not self._buf and not unsent
        if not keep:
            self.close()
        assert self._reply is not None
        if not self._reply.done():
            reply = Reply(self._status, bytes(self._body), self._headers, complete)
            self._reply.set_result((reply, keep))

    # -- parsing -------------------------------------------------------------------------------------
    def _parse(self) -> None:
        while not self._mode:
            end = self._buf.find(b"\r\n\r\n")
            if end < 0:
                if len(self._buf) > MAX_HEAD_BYTES:
                    raise ReplyError(f"reply head over {MAX_HEAD_BYTES} bytes", replied=True)
                return
            head = bytes(self._buf[:end]).decode("latin-1")
            del self._buf[: end + 4]
            if not self._head(head):
                continue  # an interim 1xx reply: the real one follows
        if self._mode == "length":
            take = min(self._left, len(self._buf), self._max_body - len(self._body))
            self._body += self._buf[:take]
            del self._buf[:take]
            self._left -= take
            if self._left == 0:
                self._done(keep=True)
            elif len(self._body) >= self._max_body:
                self._done(keep=False, complete=False)
        elif self._mode == "chunked":
            self._chunks()
        else:  # "close": read until the server closes, up to the bound
            take = min(len(self._buf), self._max_body - len(self._body))
            self._body += self._buf[:take]
            over = len(self._buf) > take
            self._buf.clear()
            if over:
                self._done(keep=False, complete=False)

    def _head(self, head: str) -> bool:
        """Read the status line and framing headers; False for an interim (1xx) reply."""
        status_line, *lines = head.split("\r\n")
        version, _, rest = status_line.partition(" ")
        code = rest[:3]
        if not version.startswith("HTTP/1.") or not (code.isascii() and code.isdigit()):
            raise ReplyError(f"not an HTTP/1.x reply: {status_line[:80]!r}", replied=True)
        status = int(code)
        if 100 <= status < 200:
            return False
        length: int | None = None
        chunked = False
        keep = version != "HTTP/1.0"
        headers: dict[str, str] = {}
        for line in lines:
            if "\r" in line or "\n" in line or "\x00" in line:  # a bare CR or LF would split it where relayed
                raise ReplyError(f"bad header line {line[:40]!r}", replied=True)
            name, _, raw_value = line.partition(":")
            name, raw_value = name.strip().lower(), raw_value.strip()
            headers[name] = raw_value
            value = raw_value.lower()
            if name == "content-length":
                if not (value.isascii() and value.isdigit()):
                    raise ReplyError(f"bad Content-Length {value[:20]!r}", replied=True)
                length = int(value)
            elif name == "transfer-encoding":
                chunked = value.endswith("chunked")
            elif name == "connection":
                keep = "close" not in value if keep else "keep-alive" in value
        self._status, self._keep, self._headers = status, keep, headers
        if status in (204, 304):
            self._mode, self._left = "length", 0
        elif chunked:
            self._mode = "chunked"
        elif length is not None:
            self._mode, self._left = "length", length
        else:
            self._mode, self._keep = "close", False
        return True

    def _chunks(self) -> None:
        """Chunked framing: `_chunk` is -1 at a chunk-size line, -2 at the CRLF after a chunk's data, else
        the data bytes left in the current chunk."""
        while True:
            if self._chunk == -1:
                end = self._buf.find(b"\r\n")
                if end < 0:
                    if len(self._buf) > 1024:
                        raise ReplyError("bad chunk size line", replied=True)
                    return
                size = bytes(self._buf[:end]).split(b";", 1)[0].strip()
                del self._buf[: end + 2]
                if not _HEX.fullmatch(size):  # int(x, 16) alone takes "-1", "0x10" and "1_0"
                    raise ReplyError(f"bad chunk size {size[:20]!r}", replied=True)
                self._chunk = int(size, 16)
                if self._chunk == 0:  # the last chunk: trailers are not read, the connection not reused
                    self._buf.clear()
                    self._done(keep=False)
                    return
            elif self._chunk == -2:
                if len(self._buf) < 2:
                    return
                del self._buf[:2]
                self._chunk = -1
            else:
                take = min(self._chunk, len(self._buf))
                room = self._max_body - len(self._body)
                self._body += self._buf[: min(take, room)]
                del self._buf[:take]
                self._chunk -= take
                if take > room:
                    self._done(keep=False, complete=False)
                    return
                if self._chunk > 0:
                    return
                self._chunk = -2


class Pool:
    """Keep-alive connections for one fan-out (or several: a caller may share one), at most `per_key` idle
    connections per pod (the fan-out: one; the router: as many as it has requests in flight to the pod) and
    `max_idle` in all (the least recently used pod's oldest closed first), each reused for at most `idle_s`.
    A pod's key is its identity and address: see the module's docstring. `connect_s` bounds a connection's
    opening (None: the caller bounds the whole call)."""

    def __init__(
        self, max_idle: int = 64, idle_s: float = IDLE_S, per_key: int = 1, connect_s: float | None = None
    ) -> None:
        self.max_idle, self.idle_s, self.per_key, self.connect_s = max_idle, idle_s, per_key, connect_s
        # by pod, the most recently idled last (taken first: the least likely to have been closed by the pod)
        self._idle: OrderedDict[tuple[str, str, int, bool], list[_Connection]] = OrderedDict()
        self._idle_count = 0
        self._open: set[_Connection] = set()
        self._tls: ssl_module.SSLContext | None = None

    async def request(self, ep: Endpoint) -> tuple[int, bytes]:
        """Send the endpoint's request and read the reply: (status, body up to MAX_REPLY_BYTES). Raises
        OSError (no connection) or ReplyError (a broken reply). The caller bounds the time (asyncio.timeout);
        a cancelled call closes its connection."""
        reply = await self.call(ep)
        return reply.status, reply.body

    async def call(
        self, ep: Endpoint, max_body: int = MAX_REPLY_BYTES, silence_s: float | None = None
    ) -> Reply:
        """`request`'s call, with the reply's headers, a bound of its own and, with `silence_s`, a
        TimeoutError once the pod has sent nothing for that long. Raises OSError where no connection could
        be opened (the request never left: nothing ran on the pod), ReplyError or TimeoutError after."""
        conn = self._take(ep.key)
        if conn is not None:
            try:
                return await self._exchange(conn, ep, max_body, silence_s)
            except ReplyError as exc:
                if exc.replied:
                    raise
                # The server closed the idle connection as the request left (its keep-alive ran out): it
                # read nothing, so the request goes once more, on a connection of its own.
        return await self._exchange(await self._connect(ep), ep, max_body, silence_s)

    async def _exchange(
        self, conn: _Connection, ep: Endpoint, max_body: int, silence_s: float | None
    ) -> Reply:
        try:
            reply, keep = await conn.send(ep.request, max_body, silence_s)
        except BaseException:
            self._drop(conn)
            raise
        if keep:
            self._put(ep.key, conn)
        else:
            self._drop(conn)
        return reply

    async def _connect(self, ep: Endpoint) -> _Connection:
        tls = None
        if ep.tls:
            self._tls = self._tls or ssl_module.create_default_context()
            tls = self._tls
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self.connect_s):
                _, conn = await loop.create_connection(_Connection, ep.host, ep.port, ssl=tls)
        except TimeoutError:
            # An OSError, as a refused connection is: the request never left. (TimeoutError is one too,
            # but callers read a TimeoutError as a silent pod after the request was sent.)
            raise ConnectionError(f"no connection within {self.connect_s} s") from None
        self._open.add(conn)
        return conn

    def _take(self, key: tuple[str, str, int, bool]) -> _Connection | None:
        conns = self._idle.get(key)
        while conns:
            conn = conns.pop()
            self._idle_count -= 1
            if not conn.closed and time.monotonic() - conn.idle_since < self.idle_s:
                if not conns:
                    del self._idle[key]
                return conn
            self._drop(conn)
        self._idle.pop(key, None)
        return None

    def _put(self, key: tuple[str, str, int, bool], conn: _Connection) -> None:
        conn.idle_since = time.monotonic()
        conns = self._idle.get(key)
        if conns is None:
            conns = self._idle[key] = []
        else:
            self._idle.move_to_end(key)
        conns.append(conn)
        self._idle_count += 1
        if len(conns) > self.per_key:
            self._drop(conns.pop(0))
            self._idle_count -= 1
        while self._idle_count > self.max_idle:
            oldest_key, oldest = next(iter(self._idle.items()))
            self._drop(oldest.pop(0))
            self._idle_count -= 1
            if not oldest:
                del self._idle[oldest_key]

    def _drop(self, conn: _Connection) -> None:
        conn.close()
        self._open.discard(conn)

    def close(self) -> None:
        """Close every connection, idle or in use."""
        for conn in self._open:
            conn.close()
        self._open.clear()
        self._idle.clear()
        self._idle_count = 0
