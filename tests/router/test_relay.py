"""router/relay.py: a pod's stream goes to the client from aiohttp's data callback, not a woken task.

A real aiohttp server on loopback, the stream's reader fed by the test (as aiohttp's parser feeds it) and
a plain socket as the client: the test blocks the event loop while it reads, so what it receives was
written before any task could run.
"""

from __future__ import annotations

import asyncio
import socket

import pytest
from aiohttp import web
from aiohttp.streams import StreamReader

from kvpilot.router.relay import Tail, relay_stream


def _recv_until(sock: socket.socket, got: bytes, end: bytes) -> bytes:
    while end not in got:
        chunk = sock.recv(65536)
        assert chunk, got
        got += chunk
    return got


@pytest.mark.parametrize("version", ["1.1", "1.0"])
def test_each_piece_is_written_to_the_client_inside_the_feed(version: str) -> None:
    """Over HTTP/1.1 each piece is one HTTP chunk written at once; HTTP/1.0 has no chunks, so there the
    task writes the body as aiohttp does (and ends it by closing)."""

    async def go() -> tuple[bytes, bytes]:
        started = asyncio.Event()
        reader: list[StreamReader] = []
        done: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()

        async def handler(request: web.Request) -> web.StreamResponse:
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            content = StreamReader(request.protocol, 1 << 16, loop=asyncio.get_running_loop())
            content.feed_data(b"data: 0\n\n")  # came with the headers
            reader.append(content)
            started.set()
            tail = Tail(12)
            await relay_stream(content, request, resp, tail)
            done.set_result(tail.bytes())
            await resp.write_eof()
            return resp

        app = web.Application()
        app.router.add_get("/", handler)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        sock = socket.create_connection(("127.0.0.1", port), timeout=10)
        try:
            sock.sendall(b"GET / HTTP/%s\r\nHost: x\r\n\r\n" % version.encode())
            await asyncio.wait_for(started.wait(), 30)
            for _ in range(5):
                await asyncio.sleep(0)  # the relay is waiting now, on the reader
            content = reader[0]
            if version == "1.0":
                for n in (1, 2):
                    content.feed_data(b"data: %d\n\n" % n)
                content.feed_eof()
                tail = await asyncio.wait_for(done, 30)
                got = b""
                while chunk := await asyncio.to_thread(sock.recv, 65536):
                    got += chunk
                return got, tail
            first = _recv_until(sock, b"", b"data: 0\n\n")
            # Blocking reads on the loop's own thread: no task runs until they return.
            content.feed_data(b"data: 1\n\n")
            got = _recv_until(sock, first, b"data: 1\n\n")
            content.feed_data(b"data: 2\n\n")
            got = _recv_until(sock, got, b"data: 2\n\n")
            content.feed_eof()
            tail = await asyncio.wait_for(done, 30)
            got = _recv_until(sock, got, b"\r\n0\r\n\r\n")
            return got, tail
        finally:
            sock.close()
            await runner.cleanup()

    got, tail = asyncio.run(go())
    body = got.partition(b"\r\n\r\n")[2]
    if version == "1.0":
        assert body == b"data: 0\n\ndata: 1\n\ndata: 2\n\n", body
    else:  # one HTTP chunk per piece, in order, then the last chunk
        assert body == b"9\r\ndata: 0\n\n\r\n9\r\ndata: 1\n\n\r\n9\r\ndata: 2\n\n\r\n0\r\n\r\n", body
    assert tail.endswith(b"data: 1\n\ndata: 2\n\n"), tail  # at least the last 12 bytes, as chunks
