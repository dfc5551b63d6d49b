"""The fan-out's own HTTP/1.1 client (kvpilot/fanout/http1.py) against real servers on loopback: keep-alive
per pod and never across pods, a stale keep-alive connection, every way a reply body is framed, the bound on
what is read, and a token that would break the request apart; and what the router's calls add (the reply's
headers, a bound of their own, a silence timer, several idle connections a pod)."""

from __future__ import annotations

import asyncio
import socket
import struct
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from kvpilot.fanout import PodResult, ResetSettings, Target, http1, run_fanout
from kvpilot.fanout.http1 import MAX_REPLY_BYTES, Pool, ReplyError, endpoint
from support.fanout import CountingPool
from support.procs import free_port


class Pod:
    """An aiohttp daemon stand-in that records, per reset call, the client port (one per connection) and the
    Authorization header it came with."""

    def __init__(self, keepalive_timeout: float = 75.0, status: int = 200) -> None:
        self.calls: list[tuple[int, str | None]] = []
        self.keepalive_timeout, self.status = keepalive_timeout, status
        self.runner: web.AppRunner | None = None
        self.site: web.TCPSite | None = None

    async def reset(self, request: web.Request) -> web.Response:
        peer = request.transport.get_extra_info("peername") if request.transport else None
        self.calls.append((peer[1] if peer else 0, request.headers.get("Authorization")))
        if self.status != 200:
            return web.json_response({"error": {"message": "try again"}}, status=self.status)
        return web.json_response({"success": True, "epoch": len(self.calls), "evicted_blocks": 1})

    async def start(self, host: str, port: int) -> None:
        app = web.Application()
        app.router.add_post("/reset_prefix_cache", self.reset)
        self.runner = web.AppRunner(app, keepalive_timeout=self.keepalive_timeout)
        await self.runner.setup()
        self.site = web.TCPSite(self.runner, host, port)
        await self.site.start()

    async def stop_listening(self) -> None:
        """Close the listening socket only: connections already open stay up, as a deleted pod's may for a
        while."""
        assert self.site is not None
        await self.site.stop()

    async def cleanup(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()


def test_a_pod_is_called_again_on_its_kept_alive_connection() -> None:
    port = free_port()
    pod = Pod(status=503)

    async def go() -> tuple[list[PodResult], int]:
        await pod.start("127.0.8.1", port)
        try:
            st = ResetSettings(port=port, retries_per_pod=2, backoff_base_s=0.01, token="t")
            return await run_fanout([Target("p", "127.0.8.1", uid="u")], st), 0
        finally:
            await pod.cleanup()

    (res,), _ = asyncio.run(go())
    assert res.result == "Failed" and res.attempts == 3 and res.http_status == 503
    # three calls (the first and two retries), one connection: the client port never changed
    assert len(pod.calls) == 3 and len({p for p, _ in pod.calls}) == 1, pod.calls


def test_a_kept_alive_connection_never_carries_a_call_to_the_pod_that_took_its_ip() -> None:
    """Pod `a` is called and its connection kept; then `a` stops listening (deleted, its process still up
    with that connection open) and pod `b` comes up at the same IP and port. The call meant for `b` goes on
    a connection of its own: connections are kept per pod, not per address."""
    port, ip = free_port(), "127.0.8.2"
    old, new = Pod(), Pod()

    async def go() -> list[PodResult]:
        await old.start(ip, port)

        async def gone(t: Target) -> str | None:
            if t.name == "b" and new.site is None:  # before b's call: the IP changes owner
                await old.stop_listening()
                await new.start(ip, port)
            return None

        try:
            targets = [Target("a", ip, uid="uid-a"), Target("b", ip, uid="uid-b")]
            st = ResetSettings(port=port, max_concurrency=1, token="fleet-token")
            return await run_fanout(targets, st, pod_gone=gone)
        finally:
            await old.cleanup()
            await new.cleanup()

    results = asyncio.run(go())
    assert [r.result for r in results] == ["Succeeded", "Succeeded"]
    assert len(old.calls) == 1, old.calls  # only its own call: b's token never reached it
    assert new.calls == [(new.calls[0][0], "Bearer fleet-token")]


def test_a_connection_the_pod_closed_while_idle_is_replaced_and_the_call_made_once() -> None:
    """The pod closes an idle connection just as the next call leaves on it (its keep-alive ran out; the
    client has not seen the close yet): the call goes again on a new connection, and the pod receives it
    once."""
    port, ip = free_port(), "127.0.8.3"
    received: list[int] = []  # one entry per request: the connection's number
    close_first = threading.Event()
    listener = socket.create_server((ip, port))

    def serve() -> None:
        for n in range(2):
            conn, _ = listener.accept()
            with conn:
                while (data := conn.recv(65536)) and b"\r\n\r\n" in data:
                    received.append(n)
                    conn.sendall(b'HTTP/1.1 200 OK\r\nContent-Length: 17\r\n\r\n{"success": true}')
                    if n == 0:
                        close_first.wait(10)
                        break  # closed unread: a request that comes now is never received

    server = threading.Thread(target=serve, daemon=True)
    server.start()

    async def go() -> tuple[list[int], int]:
        pool = CountingPool()
        try:
            ep = endpoint("uid", ip, port, False, "/reset_prefix_cache", "POST", None)
            first, _ = await pool.request(ep)
            close_first.set()
            time.sleep(0.3)  # the loop is held: the pod's close is not seen before the next call leaves
            second, _ = await asyncio.wait_for(pool.request(ep), 10)
            return [first, second], pool.opened
        finally:
            pool.close()

    try:
        statuses, opened = asyncio.run(go())
    finally:
        listener.close()
    assert statuses == [200, 200] and opened == 2
    assert received == [0, 1]  # the call that met the closed connection was made again, once


Reply = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


def pool_call(reply: Reply, **kwargs: Any) -> http1.Reply | Exception:
    """One Pool.call (the router's; the fan-out's Pool.request with the defaults) against a raw server that
    answers with `reply` (framing under the test's control)."""
    port = free_port()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        await reply(reader, writer)
        await writer.drain()

    async def go() -> http1.Reply | Exception:
        server = await asyncio.start_server(handle, "127.0.8.6", port)
        pool = Pool()
        try:
            ep = endpoint("p", "127.0.8.6", port, False, "/v1/completions", "POST", None, b"{}")
            return await asyncio.wait_for(pool.call(ep, **kwargs), 10)
        except (ReplyError, OSError) as exc:
            return exc
        finally:
            pool.close()
            server.close()

    return asyncio.run(go())


def raw_call(reply: Reply) -> tuple[int, bytes] | Exception:
    """One Pool.request (the fan-out's) against a raw server that answers with `reply`."""
    got = pool_call(reply)
    return got if isinstance(got, Exception) else (got.status, got.body)


def sends(*parts: bytes, close: bool = False, reset: bool = False) -> Reply:
    async def reply(_: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        for part in parts:  # in pieces, so every parser state meets a boundary
            writer.write(part)
            await writer.drain()
            await asyncio.sleep(0.01)
        if reset:  # closed with a linger of 0: a TCP reset, not an orderly end
            sock = writer.get_extra_info("socket")
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            writer.transport.abort()
        elif close:
            writer.close()

    return reply


def test_reply_bodies_framed_by_length_chunks_or_the_end_of_the_connection() -> None:
    body = b'{"success": true, "epoch": 3}'
    length = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 29\r\n\r\n"
    assert raw_call(sends(length[:10], length[10:] + body[:5], body[5:])) == (200, body)
    chunked = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
    parts = (chunked, b"5\r\n" + body[:5], b"\r\n18;ext=1\r", b"\n" + body[5:] + b"\r\n", b"0\r\n\r\n")
    assert raw_call(sends(*parts)) == (200, body)
    assert raw_call(sends(b"HTTP/1.0 200 OK\r\n\r\n", body, close=True)) == (200, body)
    interim = b"HTTP/1.1 100 Continue\r\n\r\n"
    assert raw_call(sends(interim, length + body)) == (200, body)
    assert raw_call(sends(b"HTTP/1.1 204 No Content\r\n\r\n")) == (204, b"")


def test_a_reply_body_is_read_up_to_the_bound_and_a_broken_reply_is_an_error() -> None:
    big = b"x" * (4 * MAX_REPLY_BYTES)
    head = f"HTTP/1.1 500 Oops\r\nContent-Length: {len(big)}\r\n\r\n".encode()
    status, body = raw_call(sends(head, big))  # type: ignore[misc]
    assert status == 500 and body == big[:MAX_REPLY_BYTES]
    assert isinstance(raw_call(sends(b"SSH-2.0-OpenSSH\r\n\r\n")), ReplyError)
    cut = raw_call(sends(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n{", close=True))
    assert isinstance(cut, ReplyError) and cut.replied and "before a full reply" in str(cut)
    # A body that runs to the connection's end, ended by a reset: cut short, not whole.
    reset = raw_call(sends(b"HTTP/1.0 200 OK\r\n\r\n", b'{"partial', reset=True))
    assert isinstance(reset, ReplyError) and reset.replied, reset
    for head in (
        b"HTTP/1.1 200 OK\r\nContent-Type: x\nX-Evil: 1\r\nContent-Length: 0\r\n\r\n",  # a bare LF
        b"HTTP/1.1 200 OK\r\nContent-Length: \xc2\xb2\r\n\r\n",  # a superscript two
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n-1\r\n",
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n0x10\r\n",
    ):
        broken = raw_call(sends(head, close=True))
        assert isinstance(broken, ReplyError) and broken.replied, (head, broken)


def test_a_token_that_would_break_the_request_apart_is_never_sent() -> None:
    port = free_port()
    pod = Pod()

    async def go() -> list[PodResult]:
        await pod.start("127.0.8.5", port)
        try:
            st = ResetSettings(port=port, token="good\r\nX-Injected: 1")
            return await run_fanout([Target("p", "127.0.8.5")], st, deadline=time.monotonic() + 10)
        finally:
            await pod.cleanup()

    (res,) = asyncio.run(go())
    assert res.result == "Failed" and "not a valid HTTP header value" in res.message and res.attempts == 0
    assert pod.calls == []


def test_a_call_gets_the_replys_headers_and_is_told_when_the_body_ran_past_its_bound() -> None:
    body = b'{"usage": {"prompt_tokens": 3}}'
    head = (
        b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nX-Ignored: a, b\r\nContent-Length: 31\r\n\r\n"
    )
    reply = pool_call(sends(head, body), max_body=len(body))
    assert isinstance(reply, http1.Reply) and reply.complete and reply.body == body
    assert reply.headers["content-type"] == "application/json" and reply.headers["x-ignored"] == "a, b"
    for framing in (
        (head, body),
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n", b"1f\r\n" + body + b"\r\n0\r\n\r\n"),
        (b"HTTP/1.0 200 OK\r\n\r\n", body),
    ):
        cut = pool_call(sends(*framing, close=True), max_body=len(body) - 1)
        assert isinstance(cut, http1.Reply) and not cut.complete and cut.body == body[:-1], framing


def test_a_silent_server_times_the_call_out_and_a_slow_steady_one_does_not() -> None:
    async def trickle(_: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 6\r\n\r\n")
        for byte in b"abcdef":  # 1.2 s in all, never 0.5 s without a byte
            await asyncio.sleep(0.2)
            writer.write(bytes([byte]))
            await writer.drain()

    async def silent(_: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await asyncio.sleep(3)

    slow = pool_call(trickle, silence_s=0.5)
    assert isinstance(slow, http1.Reply) and slow.body == b"abcdef"
    started = time.monotonic()
    timed_out = pool_call(silent, silence_s=0.5)
    assert isinstance(timed_out, TimeoutError) and time.monotonic() - started < 2.5, timed_out


def test_the_pool_keeps_as_many_idle_connections_per_pod_as_it_is_allowed() -> None:
    """Eight calls at once to one pod, twice: a pool allowed eight idle connections a pod (the router's)
    opens eight in all; the fan-out's, one a pod, opens fifteen."""
    port = free_port()
    pod = Pod()

    async def go(per_key: int) -> int:
        pool = CountingPool(per_key=per_key)
        ep = endpoint("uid", "127.0.8.7", port, False, "/reset_prefix_cache", "POST", None)
        try:
            for _ in range(2):
                replies = await asyncio.gather(*(pool.request(ep) for _ in range(8)))
                assert [status for status, _ in replies] == [200] * 8
            return pool.opened
        finally:
            pool.close()

    async def both() -> tuple[int, int]:
        await pod.start("127.0.8.7", port)
        try:
            return await go(8), await go(1)
        finally:
            await pod.cleanup()

    assert asyncio.run(both()) == (8, 15)
