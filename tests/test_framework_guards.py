"""Guards of the five places where kvpilot does a library's work its own way, for speed or for what the
library's public API lacks (issue 41; docs/performance.md, "Library insides"): the fan-out's HTTP/1.1
client (kvpilot/fanout/http1.py), the router's stream relay (router/relay.py), the listeners' connection
gate (kvpilot/serving/http_limits.py), the ZeroMQ loop waker (router/kv/loop_waker.py) and the CPU's
packed linear weights (kernels/onednn_linear.py). Each module's docstring says why it is kept and what it
leans on; these tests check exactly that, on the installed library, and fail with the library's name, the
version found and the part that changed. The end-to-end ones go through real loopback HTTP and real ZeroMQ sockets, on asyncio's loop and on uvloop (the router's
and the operator's); each takes well under 2 s."""

from __future__ import annotations

import ast
import asyncio
import inspect
import json
from collections.abc import Awaitable, Callable, Iterator
from importlib.metadata import version
from pathlib import Path
from typing import Any, TypeVar

import aiohttp
import pytest
import torch
import torch.nn.functional as F
import uvloop
import zmq
import zmq.asyncio
from aiohttp import web
from aiohttp.base_protocol import BaseProtocol
from aiohttp.http_parser import HttpResponseParser
from aiohttp.streams import StreamReader

from kvpilot.fanout import http1
from kvpilot.kernels import onednn_linear
from kvpilot.router import relay
from kvpilot.router.kv import loop_waker
from kvpilot.router.kv.loop_waker import LoopWaker, has_message
from kvpilot.serving import http_limits

ROOT = Path(__file__).resolve().parents[1]
PRODUCT = ("kvpilot", "router", "daemon", "operator", "kernels")  # the folders the image ships
LOOPS: dict[str, Callable[[], asyncio.AbstractEventLoop]] = {
    "asyncio": asyncio.new_event_loop,
    "uvloop": uvloop.new_event_loop,
}
T = TypeVar("T")


def changed(library: str, part: str, adapter: str) -> str:
    """The failure message: which library, at which version, changed which part that `adapter` leans on."""
    found = version(library)
    if library == "pyzmq":
        found += f" (libzmq {zmq.zmq_version()})"
    return f"{library} {found}: {part}; {adapter} leans on it (its docstring says why and how)"


def run_on(loop: str, main: Callable[[], Awaitable[T]]) -> T:
    with asyncio.Runner(loop_factory=LOOPS[loop]) as runner:
        return runner.run(asyncio.wait_for(main(), 10))


async def serve(app: web.Application) -> tuple[web.AppRunner, int]:
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    assert runner.addresses, "aiohttp's site is listening"
    return runner, runner.addresses[0][1]


async def read_to_close(reader: asyncio.StreamReader, within_s: float = 2.0) -> bytes | None:
    """What comes until the server closes the connection; None if it is still open after `within_s`."""
    try:
        return await asyncio.wait_for(reader.read(), within_s)
    except TimeoutError:
        return None


async def raw_exchange(port: int, request: bytes) -> bytes | None:
    """Send `request` on a new connection and read until the server closes it (None: it did not)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(request)
        return await read_to_close(reader)
    finally:
        writer.close()


def dechunk(body: bytes) -> tuple[list[bytes], bytes]:
    """A chunked HTTP body's chunks, and what follows its last (empty) chunk."""
    chunks = []
    while True:
        size_line, sep, body = body.partition(b"\r\n")
        assert sep, f"no chunk size line in {body[:80]!r}"
        size = int(size_line, 16)
        if size == 0:
            assert body.startswith(b"\r\n"), f"no CRLF after the last chunk: {body[:80]!r}"
            return chunks, body[2:]
        assert body[size : size + 2] == b"\r\n", f"a chunk of {size} bytes not followed by CRLF"
        chunks.append(body[:size])
        body = body[size + 2 :]


# -- the insides are touched in their adapter only ------------------------------------------------------

# An attribute or module name -> the one module that may use it: each is a library inside that a
# module leans on (see its docstring), so an upgrade that changes it breaks that module alone.
RELAY, WAKER = "router/relay.py", "router/kv/loop_waker.py"
HTTP1, LIMITS = "kvpilot/fanout/http1.py", "kvpilot/serving/http_limits.py"
ONEDNN = "kernels/onednn_linear.py"
ONLY_IN = {
    "__class__": RELAY,  # assigned: a live object's class swapped
    "feed_data": RELAY,
    "begin_http_chunk_receiving": RELAY,
    "end_http_chunk_receiving": RELAY,
    "FD": WAKER,
    "EVENTS": WAKER,
    "underlying": WAKER,
    "shadow": WAKER,
    "add_reader": WAKER,
    "remove_reader": WAKER,
    "create_connection": HTTP1,  # an HTTP client of our own on asyncio's transports
    "create_server": LIMITS,  # aiohttp's server behind a protocol of our own
    "_reorder_linear_weight": ONEDNN,  # torch's oneDNN ops that inductor's freezing emits
    "_linear_pointwise": ONEDNN,
}
AIOHTTP_INSIDES = (  # aiohttp's modules behind its public `aiohttp` and `aiohttp.web` names
    "aiohttp.streams",
    "aiohttp.http_parser",
    "aiohttp.http_writer",
    "aiohttp.web_protocol",
    "aiohttp.web_server",
    "aiohttp.client_proto",
    "aiohttp.base_protocol",
)


def insides_used(source: str) -> Iterator[tuple[int, str]]:
    """(line, name) of each inside of ONLY_IN or AIOHTTP_INSIDES that `source` touches."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and node.attr in ONLY_IN:
            if node.attr != "__class__" or isinstance(node.ctx, ast.Store):
                yield node.lineno, node.attr
        elif isinstance(node, ast.FunctionDef) and node.name in ONLY_IN:  # a library hook overridden
            yield node.lineno, node.name
        elif isinstance(node, ast.ImportFrom) and node.module:
            if node.module in AIOHTTP_INSIDES or node.module.startswith("aiohttp._"):
                yield node.lineno, node.module
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name in AIOHTTP_INSIDES or alias.name.startswith("aiohttp._"):
                    yield node.lineno, alias.name


def test_library_insides_are_touched_in_their_adapter_only() -> None:
    bad, seen = [], set()
    for folder in PRODUCT:
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel, source = path.relative_to(ROOT).as_posix(), path.read_text()
            if not any(name in source for name in (*ONLY_IN, "aiohttp")):
                continue  # nothing to parse for
            for line, name in insides_used(source):
                allowed = RELAY if name.startswith("aiohttp.") else ONLY_IN[name]
                seen.add(name)
                if rel != allowed:
                    bad.append(f"{rel}:{line} uses {name}, which only {allowed} may (issue 41)")
    assert not bad, "a library inside used outside its adapter:\n" + "\n".join(bad)
    assert seen >= set(ONLY_IN) | {"aiohttp.streams"}, f"the check no longer sees {set(ONLY_IN) - seen}"


# -- kvpilot/fanout/http1.py ------------------------------------------------------------------------------


@pytest.mark.parametrize("loop", sorted(LOOPS))
def test_http1_reads_and_keeps_alive_aiohttps_server_replies(loop: str) -> None:
    """The fan-out's client against aiohttp's server, as a kvpilot daemon answers: a JSON reply by length
    on a kept-alive connection (the second call rides it), a chunked stream, and a reply that closes."""
    ports: list[int] = []
    body = {"success": True, "epoch": 1, "evicted_blocks": 3}

    async def reset(request: web.Request) -> web.Response:
        assert request.transport is not None
        ports.append(request.transport.get_extra_info("peername")[1])
        return web.json_response(body)

    async def stream(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse()
        await resp.prepare(request)
        for piece in (b'{"success": ', b"true}"):
            await resp.write(piece)
        await resp.write_eof()
        return resp

    async def closing(request: web.Request) -> web.Response:
        resp = web.json_response(body)
        resp.force_close()
        return resp

    async def main() -> list[tuple[int, bytes]]:
        app = web.Application()
        app.router.add_post("/reset_prefix_cache", reset)
        app.router.add_post("/stream", stream)
        app.router.add_post("/close", closing)
        runner, port = await serve(app)
        pool = http1.Pool()
        try:
            out = []
            for path in ("/reset_prefix_cache", "/reset_prefix_cache", "/stream", "/close", "/close"):
                ep = http1.endpoint("pod", "127.0.0.1", port, False, path, "POST", "token")
                out.append(await pool.request(ep))
            return out
        finally:
            pool.close()
            await runner.cleanup()

    try:
        replies = run_on(loop, main)
    except (http1.ReplyError, OSError, TimeoutError) as exc:
        pytest.fail(
            changed("aiohttp", f"its server's reply is no longer read by the fan-out's client ({exc})", HTTP1)
        )
    for status, got in replies[:2] + replies[3:]:
        assert status == 200 and json.loads(got) == body, changed(
            "aiohttp", f"its JSON reply reads {got!r}", HTTP1
        )
    assert replies[2] == (200, b'{"success": true}'), changed(
        "aiohttp", f"its chunked reply reads {replies[2]}", HTTP1
    )
    assert len(ports) == 2 and ports[0] == ports[1], changed(
        "aiohttp", "its server no longer keeps the connection of a reply by length alive", HTTP1
    )


# -- router/relay.py ------------------------------------------------------------------------------------


def test_relay_reader_swap_matches_aiohttps_stream_reader() -> None:
    """`_Relaying` can take a live StreamReader's place, and overrides the parser's hooks as they are."""
    adapter = RELAY
    assert "__slots__" in vars(StreamReader) and StreamReader.__dictoffset__ == 0, changed(
        "aiohttp", "aiohttp.streams.StreamReader no longer has __slots__ only", adapter
    )
    assert relay._Relaying.__bases__ == (StreamReader,) and vars(relay._Relaying)["__slots__"] == ()
    assert relay._Relaying.__basicsize__ == StreamReader.__basicsize__, changed(
        "aiohttp", "aiohttp.streams.StreamReader's layout", adapter
    )
    for hook in ("feed_data", "begin_http_chunk_receiving", "end_http_chunk_receiving"):
        theirs = getattr(StreamReader, hook, None)
        assert theirs is not None, changed("aiohttp", f"StreamReader.{hook} is gone", adapter)
        ours = inspect.signature(getattr(relay._Relaying, hook))
        params = [(p.name, p.kind, p.default) for p in inspect.signature(theirs).parameters.values()]
        assert [(p.name, p.kind, p.default) for p in ours.parameters.values()] == params, changed(
            "aiohttp", f"StreamReader.{hook}{inspect.signature(theirs)} (ours: {ours})", adapter
        )
    for method in ("read_nowait", "readany", "set_exception", "feed_eof"):
        assert callable(getattr(StreamReader, method, None)), changed(
            "aiohttp", f"StreamReader.{method} is gone", adapter
        )

    async def swap() -> None:
        reader = StreamReader(BaseProtocol(asyncio.get_running_loop()), 1 << 16)
        reader.__class__ = relay._Relaying
        reader.__class__ = StreamReader

    try:
        run_on("asyncio", swap)
    except TypeError as exc:
        pytest.fail(changed("aiohttp", f"a StreamReader's class cannot be swapped ({exc})", adapter))


@pytest.mark.parametrize("loop", sorted(LOOPS))
def test_relay_is_fed_by_aiohttps_parser_and_frames_chunks_as_its_writer(
    loop: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A pod (aiohttp's server) streams events, the router's handler relays them from its aiohttp client
    response, and a raw client reads what reached it: the pieces were written from inside aiohttp's data
    callback (the sink wrote them), after the head that `prepare()` sent, as chunks that aiohttp's own
    `write_eof()` ends."""
    pieces = [b"data: %d\n\n" % i for i in range(4)]
    relayed: list[bytes] = []
    real_relay = relay._Sink.relay

    def counted(sink: relay._Sink, data: bytes) -> bool:
        done = real_relay(sink, data)
        if done:
            relayed.append(data)
        return done

    monkeypatch.setattr(relay._Sink, "relay", counted)
    content_types: list[type] = []

    async def pod(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for piece in pieces:
            await resp.write(piece)
            await asyncio.sleep(0.02)  # each its own read on the router's side
        await resp.write_eof()
        return resp

    async def main() -> tuple[bytes | None, bytes]:
        pod_app = web.Application()
        pod_app.router.add_get("/", pod)
        pod_runner, pod_port = await serve(pod_app)
        session = aiohttp.ClientSession()
        tails: list[bytes] = []

        async def router(request: web.Request) -> web.StreamResponse:
            async with session.get(f"http://127.0.0.1:{pod_port}/") as up:
                content_types.append(type(up.content))
                resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
                await resp.prepare(request)
                tail = relay.Tail(9)
                await relay.relay_stream(up.content, request, resp, tail)
                tails.append(tail.bytes())
                await resp.write_eof()
                return resp

        router_app = web.Application()
        router_app.router.add_get("/", router)
        router_runner, router_port = await serve(router_app)
        try:
            raw = await raw_exchange(router_port, b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        finally:
            await session.close()
            await router_runner.cleanup()
            await pod_runner.cleanup()
        return raw, tails[0] if tails else b""

    raw, tail = run_on(loop, main)
    raw = raw or b""  # None: the router never closed the client's connection
    parser = HttpResponseParser.__module__
    assert content_types == [StreamReader], changed(
        "aiohttp",
        f"its client's response body is a {content_types}, not aiohttp.streams.StreamReader: "
        "relay_stream falls back to a task per chunk",
        RELAY,
    )
    assert len(relayed) >= 2, changed(  # more than what came with the head (`first`): the parser's feed
        "aiohttp",
        f"its response parser ({parser}) no longer hands the body over by StreamReader.feed_data "
        f"(relayed from the data callback: {relayed})",
        RELAY,
    )
    head, _, body = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200") and b"transfer-encoding: chunked" in head.lower(), changed(
        "aiohttp",
        f"web.StreamResponse.prepare() no longer writes the head at once: the client got {raw[:120]!r}",
        RELAY,
    )
    try:
        chunks, after = dechunk(body)
    except (AssertionError, ValueError) as exc:
        pytest.fail(changed("aiohttp", f"its writer's chunk framing ({exc}): {body!r}", RELAY))
    assert b"".join(chunks) == b"".join(pieces) and after == b"", changed(
        "aiohttp", f"its writer's chunk framing: {body!r}", RELAY
    )
    assert tail.endswith(pieces[-1]), tail


# -- kvpilot/serving/http_limits.py ---------------------------------------------------------------------

PROTOCOL_CALLBACKS = {  # what an asyncio transport calls on its protocol
    name
    for cls in (asyncio.BaseProtocol, asyncio.Protocol, asyncio.BufferedProtocol)
    for name in vars(cls)
    if not name.startswith("__")
}


def test_http_limits_gate_passes_on_every_callback_aiohttps_protocol_takes() -> None:
    """What `runner.server` makes is a plain asyncio.Protocol whose every callback the gate passes on, and
    aiohttp never asks a transport for its protocol (it would get the gate)."""
    forwarded = {name for name in vars(http_limits._Guarded) if name in PROTOCOL_CALLBACKS}

    async def handler_class() -> type:
        runner = web.AppRunner(web.Application())
        await runner.setup()
        try:
            assert runner.server is not None
            return type(runner.server())
        finally:
            await runner.cleanup()

    cls = run_on("asyncio", handler_class)
    assert issubclass(cls, asyncio.Protocol) and not issubclass(cls, asyncio.BufferedProtocol), changed(
        "aiohttp",
        f"its server protocol {cls.__module__}.{cls.__qualname__} is no plain asyncio.Protocol",
        LIMITS,
    )
    takes = {name for name in PROTOCOL_CALLBACKS if callable(getattr(cls, name, None))}
    assert takes <= forwarded, changed(
        "aiohttp",
        f"its server protocol takes {sorted(takes - forwarded)}, which the gate does not pass on",
        LIMITS,
    )
    users = [
        f"{path.name}:{n}"
        for path in sorted(Path(aiohttp.__file__).parent.glob("*.py"))
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if "get_protocol(" in line or "set_protocol(" in line
    ]
    assert not users, changed("aiohttp", f"it asks a transport for its protocol ({users})", LIMITS)


@pytest.mark.parametrize("loop", sorted(LOOPS))
def test_http_limits_gate_serves_through_aiohttp_end_to_end(
    loop: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Through `start_server`: two requests on one kept-alive connection, which aiohttp's keep-alive timer
    then closes; a half header answered 408 by the gate; a connection past the cap 503; and a connection
    the gate handed over registered with aiohttp's server, so that the runner's cleanup ends it."""
    monkeypatch.setattr(http_limits, "UPSTREAM_IDLE_S", 0.0)  # a header timeout short enough for a test

    async def ok(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def main() -> dict[str, Any]:
        app = web.Application()
        app.router.add_get("/", ok)
        limits = http_limits.ConnectionLimits(header_timeout=0.3, max_connections=2)
        served = await http_limits.start_server(app, "127.0.0.1", 0, limits, shutdown_timeout=0.5)
        port, got = served.port, {}
        try:
            kept_r, kept_w = await asyncio.open_connection("127.0.0.1", port)
            for name in ("first", "second"):
                kept_w.write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
                got[name] = await kept_r.readuntil(b"ok")
            slow_r, slow_w = await asyncio.open_connection("127.0.0.1", port)
            slow_w.write(b"GET / HTTP/1.1\r\nHost: x\r\nX-Slow: ")
            await asyncio.sleep(0.05)  # both accepted: the cap is reached
            got["past the cap"] = await raw_exchange(port, b"")
            got["slow"] = await read_to_close(slow_r)
            got["kept, idle"] = await read_to_close(kept_r)
            slow_w.close()
            kept_w.close()
            held_r, held_w = await asyncio.open_connection("127.0.0.1", port)
            held_w.write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            await held_r.readuntil(b"ok")
            assert served.runner.server is not None
            got["registered"] = len(served.runner.server.connections)
        finally:
            await served.cleanup()
        got["held, after cleanup"] = await read_to_close(held_r)
        held_w.close()
        return got

    got = run_on(loop, main)
    for name in ("first", "second"):
        assert got[name].startswith(b"HTTP/1.1 200"), changed(
            "aiohttp", f"its protocol behind the gate answered the {name} request {got[name]!r}", LIMITS
        )
    assert (got["past the cap"] or b"").startswith(b"HTTP/1.1 503"), got["past the cap"]
    assert (got["slow"] or b"").startswith(b"HTTP/1.1 408") and b"header_timeout" in got["slow"], changed(
        "aiohttp", f"a half header got {got['slow']!r}, not the gate's 408", LIMITS
    )
    assert got["kept, idle"] == b"", changed(
        "aiohttp",
        "its keep-alive timer (keepalive_timeout) no longer closes an idle kept-alive connection",
        LIMITS,
    )
    assert got["registered"] == 1 and got["held, after cleanup"] == b"", changed(
        "aiohttp",
        "RequestHandler.connection_made no longer registers the connection with its web.Server "
        f"({got['registered']} registered)",
        LIMITS,
    )


# -- router/kv/loop_waker.py ------------------------------------------------------------------------------


def test_loop_waker_pyzmq_surface() -> None:
    for name in ("FD", "EVENTS", "POLLIN", "NOBLOCK"):
        assert isinstance(getattr(zmq, name, None), int), changed("pyzmq", f"zmq.{name} is gone", WAKER)
    assert inspect.ismethod(getattr(zmq.Socket, "shadow", None)), changed(
        "pyzmq", "zmq.Socket.shadow is no classmethod", WAKER
    )
    assert hasattr(zmq.asyncio.Socket, "underlying"), changed("pyzmq", "Socket.underlying is gone", WAKER)


async def woken_with_message(
    waker: LoopWaker, plain: zmq.Socket, pub: zmq.asyncio.Socket, payload: bytes, within_s: float
) -> bool:
    """Publish `payload`, waiting as a stream does (clear, look, wait; looking reads EVENTS, which lets the
    descriptor signal again): True once a wake finds a message, or one was there before it was sent."""
    waker.clear()
    if has_message(plain):
        return True
    await pub.send(payload)
    deadline = asyncio.get_running_loop().time() + within_s
    while await waker.wait(max(0.0, deadline - asyncio.get_running_loop().time())):
        waker.clear()
        if has_message(plain):
            return True
    return False


@pytest.mark.parametrize("loop", sorted(LOOPS))
def test_loop_waker_wakes_on_a_message_and_quiets_its_descriptor(
    loop: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A SUB socket's waker, over tcp on loopback: a published batch wakes it; while the task reads nothing
    the descriptor is quiet once `_wake` read EVENTS (the level-triggered loop calls it once or twice, not
    in a spin); the next message wakes it again; after `close()` nothing does."""
    wakes: list[int] = []
    real_wake = LoopWaker._wake

    def counted(waker: LoopWaker, sock: zmq.Socket) -> None:
        wakes.append(1)
        real_wake(waker, sock)

    monkeypatch.setattr(loop_waker.LoopWaker, "_wake", counted)

    async def main() -> dict[str, Any]:
        ctx = zmq.asyncio.Context()
        pub, sub = ctx.socket(zmq.PUB), ctx.socket(zmq.SUB)
        got: dict[str, Any] = {}
        try:
            pub.bind("tcp://127.0.0.1:*")
            sub.setsockopt(zmq.SUBSCRIBE, b"")
            sub.connect(pub.getsockopt_string(zmq.LAST_ENDPOINT))
            waker = LoopWaker()
            plain = waker.watch(sub)
            got["shares the socket"] = plain.underlying == sub.underlying
            for _ in range(100):  # until the subscription has reached the publisher
                got["woken"] = await woken_with_message(waker, plain, pub, b"first", 0.02)
                if got["woken"]:
                    break

            async def wakes_while_unread(payload: bytes, wait_s: float) -> int:
                """Drain, publish `payload`, and count the wakes while nothing reads it (the task woken,
                then busy elsewhere)."""
                while has_message(plain):
                    plain.recv(zmq.NOBLOCK)
                waker.clear()
                before = len(wakes)
                await pub.send(payload)
                await waker.wait(wait_s)
                await asyncio.sleep(0.1)
                return len(wakes) - before

            got["wakes while unread"] = await wakes_while_unread(b"second", 2.0)
            got["second"] = plain.recv(zmq.NOBLOCK) if has_message(plain) else None
            got["drained"] = not has_message(plain)
            got["woken again"] = await woken_with_message(waker, plain, pub, b"third", 2.0)
            waker.close()
            got["wakes after close"] = await wakes_while_unread(b"fourth", 0.0)
        finally:
            pub.close(0)
            sub.close(0)
            ctx.term()
        return got

    got = run_on(loop, main)
    assert got["shares the socket"], changed("pyzmq", "Socket.shadow(underlying) is another socket", WAKER)
    assert got["woken"], changed("pyzmq", "a ZeroMQ socket's FD no longer wakes the loop on a message", WAKER)
    assert 1 <= got["wakes while unread"] <= 3 and got["second"] == b"second", changed(
        "pyzmq",
        f"_wake ran {got['wakes while unread']} times while a message lay unread (1 to 3 expected: none is an "
        "FD that no longer signals, more is one that reading EVENTS no longer quiets)",
        WAKER,
    )
    assert got["drained"] and got["woken again"], changed(
        "pyzmq", "the FD no longer signals a message once EVENTS was read", WAKER
    )
    assert got["wakes after close"] == 0, got


# -- kernels/onednn_linear.py ------------------------------------------------------------------------------


@pytest.mark.parametrize("rows", [1, 8, 33, 300])
def test_onednn_linear_a_packed_weight_multiplies_as_f_linear(rows: int) -> None:
    """torch.ops.mkldnn's `_reorder_linear_weight` and `_linear_pointwise` (the module's docstring): a
    weight reordered once, then multiplied with and without a bias, at any row count."""
    for op in ("_reorder_linear_weight", "_linear_pointwise"):
        assert hasattr(torch.ops.mkldnn, op), changed("torch", f"torch.ops.mkldnn.{op} is gone", ONEDNN)
    if not onednn_linear.packable(torch.zeros(8, 8)):
        pytest.skip(f"torch {torch.__version__} here has no oneDNN for float32 (the module falls back)")
    torch.manual_seed(rows)
    weight, bias, x = torch.randn(96, 40), torch.randn(96), torch.randn(rows, 40)
    packed = onednn_linear.pack(weight)
    for got, want in (
        (onednn_linear.multiply(x, packed, 96, bias), F.linear(x, weight, bias)),
        (onednn_linear.multiply(x, packed, 96), F.linear(x, weight)),
    ):
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-5), changed(
            "torch", f"_linear_pointwise of a reordered weight is not F.linear's at {rows} rows", ONEDNN
        )
