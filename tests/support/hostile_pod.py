"""A kvpilot pod that lies, trickles or goes silent, for the router's bounds tests (tests/router/
test_hostile_pods.py): a real aiohttp server and real ZeroMQ PUB and ROUTER (replay) sockets on loopback,
run by a thread of the test process, every behaviour a knob the test sets.

HTTP: `GET /health` (status `health_status`, after `health_delay_s`), `GET /kv_events` (the honest reply naming its sockets, or
`kv_events_reply`, any JSON value), `POST /reset_prefix_cache` (a daemon's success reply; it records an
AllBlocksCleared batch, published live only with `publish_live`), `POST /v1/completions` (by `completion`:
"ok", "silent", "huge" (`huge_bytes` of JSON), "huge_gzip" (the same, gzipped), "stream_then_silent",
"stream_flood" (`flood_events` events of `huge_bytes` padding each, numbered, as fast as it can)).
Replay (`replay`): "honest" (the buffer, then end-of-replay), "trickle" (one batch a second, never ending),
"flood" (`flood_batches` batches of `flood_payload` bytes, then end-of-replay), "silent".
"""

from __future__ import annotations

import asyncio
import gzip
import os
import threading
from collections.abc import Awaitable, Callable
from typing import Any

import msgpack
import zmq
import zmq.asyncio
from aiohttp import web

from kvpilot.kv.events import END_OF_REPLAY, AllBlocksCleared, BlockStored, EventBatch, encode_batch


def endless_json(start: bytes) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
    """An aiohttp handler whose JSON reply begins with `start` and never ends: for a reader's byte cap."""

    async def handler(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "application/json"})
        await resp.prepare(request)
        await resp.write(start)
        while True:
            await resp.write(b"1, " * 65536)

    return handler


def seq_frame(seq: int) -> bytes:
    return seq.to_bytes(8, "big", signed=True)


def stored(hashes: list[Any]) -> bytes:
    """A batch storing `hashes` (not necessarily valid block keys), encoded as a daemon sends it."""
    event = {
        "type": "BlockStored",
        "block_hashes": hashes,
        "parent_block_hash": None,
        "token_ids": [],
        "block_size": 16,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
    }
    return msgpack.packb([0.0, [event], 0])


def stored_keys(hashes: list[bytes]) -> bytes:
    """A batch storing `hashes`, through the daemon's own encoder."""
    return encode_batch(EventBatch(0.0, [BlockStored(hashes, None, [], 16)]))


def random_keys(n: int) -> list[bytes]:
    return [os.urandom(32) for _ in range(n)]


class HostilePod:
    def __init__(
        self, blocks_total: int = 64, buffer_batches: int = 1000, buffer_bytes: int = 1 << 20
    ) -> None:
        self.health_status = 200
        self.health_delay_s = 0.0
        self.kv_events_reply: Any = None  # None: the honest reply
        self.completion = "ok"
        self.huge_bytes = 0
        self.flood_events = 0
        self.replay = "honest"
        self.flood_batches = 0
        self.flood_payload = 100
        self.publish_live = True
        self.blocks_total = blocks_total
        self.buffer_batches = buffer_batches
        self.buffer_bytes = buffer_bytes
        self.buffer: list[tuple[int, bytes]] = []
        self.replay_requests = 0
        self.completion_ports: list[int] = []  # the client port of each completion request (its connection)
        self._answers: set[asyncio.Task] = set()
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name="hostile-pod", daemon=True)
        self._thread.start()
        if not self._ready.wait(30):
            raise RuntimeError("the hostile pod did not start")

    # ---- from the test ---------------------------------------------------------------------------
    def record(self, payload: bytes) -> int:
        """Add a batch to the replay buffer (and publish it live with `publish_live`); returns its seq."""
        return self._call(self._record(payload))

    def send_raw(self, frames: list[bytes]) -> None:
        """Publish any frames live, as they are."""
        self._call(self._send(frames))

    def stop(self) -> None:
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(10)

    def _call(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(10)

    # ---- the pod's thread ------------------------------------------------------------------------
    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_until_complete(self._main())

    async def _main(self) -> None:
        self._stop = asyncio.Event()
        ctx = zmq.asyncio.Context()
        self._pub = ctx.socket(zmq.PUB)
        self._pub.bind("tcp://127.0.0.1:*")
        self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self._router = ctx.socket(zmq.ROUTER)
        self._router.bind("tcp://127.0.0.1:*")
        self.replay_endpoint = self._router.getsockopt_string(zmq.LAST_ENDPOINT)
        app = web.Application()
        app.router.add_get("/health", self._health)
        app.router.add_get("/kv_events", self._kv_events)
        app.router.add_post("/reset_prefix_cache", self._reset)
        app.router.add_post("/v1/completions", self._completions)
        runner = web.AppRunner(app, handler_cancellation=True)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]
        self.name = f"127.0.0.1:{self.port}"  # as the router names it (--endpoints)
        self.url = f"http://{self.name}"
        serving = asyncio.create_task(self._serve_replays())
        self._ready.set()
        await self._stop.wait()
        for task in (serving, *self._answers):
            task.cancel()
        await asyncio.gather(serving, *self._answers, return_exceptions=True)
        await runner.cleanup()
        self._pub.close(linger=0)
        self._router.close(linger=0)
        ctx.term()

    async def _send(self, frames: list[bytes]) -> None:
        await self._pub.send_multipart(frames)

    async def _record(self, payload: bytes) -> int:
        seq = len(self.buffer)
        self.buffer.append((seq, payload))
        if self.publish_live:
            await self._pub.send_multipart([b"", seq_frame(seq), payload])
        return seq

    async def _serve_replays(self) -> None:
        while True:
            client, _, start = await self._router.recv_multipart()
            self.replay_requests += 1
            task = asyncio.create_task(self._answer(client, int.from_bytes(start, "big", signed=True)))
            self._answers.add(task)
            task.add_done_callback(self._answers.discard)

    async def _answer(self, client: bytes, start: int) -> None:
        send = self._router.send_multipart
        if self.replay == "silent":
            return
        if self.replay == "trickle":
            seq = max(start, len(self.buffer))
            while True:  # valid batches, each well within any silence limit, and no end
                await send([client, b"", b"", seq_frame(seq), stored(random_keys(1))])
                seq += 1
                await asyncio.sleep(1.0)
        if self.replay == "flood":
            for i in range(self.flood_batches):
                await send([client, b"", b"", seq_frame(start + i), os.urandom(self.flood_payload)])
        else:
            for seq, payload in list(self.buffer):
                if seq >= start:
                    await send([client, b"", b"", seq_frame(seq), payload])
        await send([client, b"", b"", seq_frame(END_OF_REPLAY), b""])

    async def _health(self, request: web.Request) -> web.Response:
        await asyncio.sleep(self.health_delay_s)
        return web.Response(status=self.health_status, text="ok")

    async def _kv_events(self, request: web.Request) -> web.Response:
        reply = self.kv_events_reply
        if reply is None:
            reply = {
                "endpoint": self.endpoint,
                "replay_endpoint": self.replay_endpoint,
                "topic": "",
                "format": "vllm",
                "block_size": 16,
                "blocks_total": self.blocks_total,
                "buffer_batches": self.buffer_batches,
                "buffer_bytes": self.buffer_bytes,
                "ranks": [
                    {
                        "rank": 0,
                        "endpoint": self.endpoint,
                        "replay_endpoint": self.replay_endpoint,
                        "blocks_total": self.blocks_total,
                    }
                ],
            }
        return web.json_response(reply)

    async def _reset(self, request: web.Request) -> web.Response:
        await self._record(encode_batch(EventBatch(0.0, [AllBlocksCleared()])))
        return web.json_response(
            {"success": True, "epoch": 1, "evicted_blocks": 0, "ranks": [{"rank": 0, "success": True}]}
        )

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        await request.read()
        peer = request.transport.get_extra_info("peername") if request.transport else None
        self.completion_ports.append(peer[1] if peer else 0)
        if self.completion == "silent":
            await asyncio.sleep(3600)
        if self.completion == "huge":
            return web.Response(
                body=b'{"pad": "' + b"x" * self.huge_bytes + b'"}', content_type="application/json"
            )
        if self.completion == "huge_gzip":  # a small Content-Length that inflates past any cap
            body = gzip.compress(b'{"pad": "' + b"x" * self.huge_bytes + b'"}')
            headers = {"Content-Type": "application/json", "Content-Encoding": "gzip"}
            return web.Response(body=body, headers=headers)
        if self.completion == "stream_then_silent":
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            await resp.write(b'data: {"choices": [{"index": 0, "text": "one"}]}\n\n')
            await asyncio.sleep(3600)
        if self.completion == "stream_flood":
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            pad = "x" * self.huge_bytes
            for n in range(self.flood_events):
                await resp.write(b'data: {"n": %d, "pad": "%s"}\n\n' % (n, pad.encode()))
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
            return resp
        return web.json_response({"object": "text_completion", "choices": [{"index": 0, "text": "ok"}]})
