"""A pod's server-sent event stream relayed to the client from inside the upstream's data callback.

Read the usual way (`async for chunk in up.content`), every chunk costs a future resolved, a task woken,
three coroutine frames resumed and aiohttp's writer layers, on top of the one socket write. Here the
response's reader is switched to `_Relaying`, whose `feed_data` (called by aiohttp's parser as the pod's
bytes arrive) writes each piece straight to the client's transport, framed as one HTTP chunk: the
handler's task sleeps until the stream ends or fails. What aiohttp does between the socket and the
reader is unchanged, so `--proxy-timeout` (its read timer), a pod that drops the connection and a client
that hangs up (its handler is cancelled) end the stream as before.

A client that reads slowly is not written past: once its transport holds more than `CLIENT_BUFFER_MAX`
bytes the pieces go to the reader's buffer instead (which pauses the pod's socket when full), and the
task writes them with aiohttp's draining writes until it has caught up.

Why it is kept, and what of aiohttp it leans on, in this module only. bench/router_cost.py
(docs/performance.md, "Router", 2026-12-01): the router's CPU per streamed chunk was 28.7 µs read the
public way (a task woken per chunk, main cbc87b7) against 11.7-22.1 µs relayed here in the same half hour,
1.57x sglang-router's against 0.90-1.06x: far more than the 10% within which the public API would have
replaced it. The insides it leans on:
- `aiohttp.streams.StreamReader` is the exact class aiohttp's client makes for a response body (another
  class is never switched: `relay_stream` then falls back to the task, correct but without the gain), and
  it has `__slots__`, so `_Relaying` (no slots of its own) can take its place by `__class__`;
- aiohttp's response parser (the C `aiohttp._http_parser` or `aiohttp.http_parser`) hands the body over
  by `StreamReader.feed_data(data, size)` as the bytes arrive (the bool it returns read as "more data
  available") and calls `begin_http_chunk_receiving()` and `end_http_chunk_receiving()` around each
  chunk of a chunked body;
- `web.StreamResponse.prepare()` writes the headers to the transport at once, and its writer keeps no
  bytes of its own: it frames each chunk as `%x\r\n...\r\n` and ends with `0\r\n\r\n` on `write_eof()`,
  so the chunks this module writes to the transport fall in between.
Verified on aiohttp 3.14.5 (its C parser; asyncio and uvloop 0.23.0, CPython 3.11). The guard,
tests/test_framework_guards.py (`test_relay_*`), fails on a version that changes any of these, naming it.
"""

from __future__ import annotations

import asyncio
import collections

from aiohttp import hdrs, web
from aiohttp.streams import StreamReader

CLIENT_BUFFER_MAX = 0x10000  # bytes queued for the client beyond which relaying waits for it (aiohttp's)


class Tail:
    """The last `max_bytes` or more of what was relayed, as its chunks: the caller's, so what was relayed
    is known even when the relay is cancelled (a client that hangs up once it has what it wanted)."""

    __slots__ = ("chunks", "kept", "max_bytes")

    def __init__(self, max_bytes: int) -> None:
        self.chunks: collections.deque[bytes] = collections.deque()
        self.kept = 0
        self.max_bytes = max_bytes

    def keep(self, data: bytes) -> None:
        chunks = self.chunks
        chunks.append(data)
        self.kept += len(data)
        while self.kept - len(chunks[0]) >= self.max_bytes:
            self.kept -= len(chunks.popleft())

    def bytes(self) -> bytes:
        return b"".join(self.chunks)


class _Sink:
    """Where one stream's bytes go; `tail`, when given, keeps the last of them."""

    __slots__ = ("transport", "queued", "tail")

    def __init__(self, transport: asyncio.Transport | None, tail: Tail | None) -> None:
        self.transport = transport
        self.queued = False  # pieces wait in the reader's buffer: keep their order until the task caught up
        self.tail = tail

    def keep(self, data: bytes) -> None:
        if self.tail is not None:
            self.tail.keep(data)

    def relay(self, data: bytes) -> bool:
        """Write `data` to the client now, if it keeps up; False: leave it to the task."""
        t = self.transport
        assert t is not None  # only a sink with a transport relays (the task's has none)
        if self.queued or t.is_closing() or t.get_write_buffer_size() > CLIENT_BUFFER_MAX:
            self.queued = True
            return False
        t.write(b"%x\r\n%s\r\n" % (len(data), data))
        self.keep(data)
        return True


# The reader has __slots__, so a relaying one cannot carry its sink: sinks are found by the reader's id,
# registered only while `relay_stream` runs.
_SINKS: dict[int, _Sink] = {}


class _Relaying(StreamReader):
    """aiohttp's reader whose pieces go to the stream's sink when it takes them."""

    __slots__ = ()

    def feed_data(self, data: bytes, size: int = 0) -> bool:
        sink = _SINKS.get(id(self))
        if sink is not None and data and sink.relay(data):
            return False
        return StreamReader.feed_data(self, data, size)

    # HTTP chunk boundaries only matter to readchunk(), which nothing calls here; aiohttp's versions of
    # these would wake the task on every chunk.
    def begin_http_chunk_receiving(self) -> None:
        pass

    def end_http_chunk_receiving(self) -> None:
        pass


async def relay_stream(
    content: StreamReader, request: web.Request, resp: web.StreamResponse, tail: Tail | None = None
) -> None:
    """Send `content` to the client as the body of `resp` (prepared, chunked) until its end, keeping its
    last bytes in `tail`. Raises what reading the pod raises (aiohttp.ClientError, TimeoutError); the bytes
    relayed before stay sent (and kept)."""
    transport = request.transport
    # Framed here as HTTP chunks: an HTTP/1.0 client's body is not chunked (aiohttp ends it by closing).
    chunked = resp.headers.get(hdrs.TRANSFER_ENCODING, "").lower() == "chunked"
    if transport is None or not chunked or type(content) is not StreamReader:
        return await _relay_by_task(content, resp, _Sink(None, tail))
    sink = _Sink(transport, tail)
    key = id(content)
    first = content.read_nowait()  # what came with the headers: it goes first
    content.__class__ = _Relaying  # same layout (no new slots): aiohttp's parser now feeds the sink
    _SINKS[key] = sink
    try:
        if first and not sink.relay(first):
            await resp.write(first)  # the client is behind already: wait for it
            sink.keep(first)
        return await _relay_by_task(content, resp, sink)
    finally:
        del _SINKS[key]
        content.__class__ = StreamReader


async def _relay_by_task(content: StreamReader, resp: web.StreamResponse, sink: _Sink) -> None:
    """The task's part: write what the sink left in the reader's buffer, then sleep until more is left
    there, or the stream ends (b"" from readany) or fails (raised)."""
    write = resp.write
    while True:
        data = await content.readany()
        if not data:
            break
        await write(data)
        sink.keep(data)
        # Caught up (nothing buffered, and nothing can arrive before the next await): back to relaying.
        while data := content.read_nowait():
            await write(data)
            sink.keep(data)
        sink.queued = False
