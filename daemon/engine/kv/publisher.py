"""Publishes the engine's KV events on ZeroMQ, in the wire format of kvpilot/kv/events.py (frames,
sequence numbers, replay and bounds are described there), and says where (GET /kv_events).

The engine records events while it schedules (on its own thread, no I/O: kv/recorder.py) and hands one
batch per step to the publisher thread, which owns the sockets. With events off, the pool holds no recorder
and nothing here runs.
"""

from __future__ import annotations

import enum
import logging
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Final

import zmq

from kvpilot.daemon.engine.kv.recorder import KVEventRecorder
from kvpilot.kv import sockets as kv_sockets
from kvpilot.kv.block_keys import DEFAULT_KEYS, KeyScheme
from kvpilot.kv.events import (
    DEFAULT_BUFFER_BATCHES,
    DEFAULT_BUFFER_BYTES,
    END_OF_REPLAY,
    EventBatch,
    encode_batches,
)

log = logging.getLogger(__name__)


class _Idle(enum.Enum):
    IDLE = enum.auto()


_IDLE: Final = _Idle.IDLE  # the publisher thread found nothing queued


class KVEventPublisher:
    """PUB socket plus an optional ROUTER replay socket with a bounded buffer of recent messages.

    The daemon binds both (it is the stable side; routers come and go). `publish()` is cheap and never
    blocks the engine: encoding and sending happen on the publisher thread.
    """

    def __init__(
        self,
        endpoint: str,
        replay_endpoint: str | None = None,
        block_size: int = 16,
        rank: int = 0,
        topic: str = "",
        buffer_batches: int = DEFAULT_BUFFER_BATCHES,
        token_ids: bool = False,
        curve_dir: str | None = None,
        buffer_bytes: int = DEFAULT_BUFFER_BYTES,
        blocks_total: int | None = None,
        keys: KeyScheme = DEFAULT_KEYS,
    ) -> None:
        self.recorder = KVEventRecorder(block_size, token_ids)
        self.rank = rank
        self.topic = topic
        self.keys = keys
        self.blocks_total = blocks_total  # the pool's and offload tiers' blocks: no index of it can hold more
        self._topic = topic.encode()
        self._queue: queue.SimpleQueue[EventBatch | None] = queue.SimpleQueue()
        self._buffer: deque[tuple[int, bytes]] = deque()
        self._buffer_batches = buffer_batches
        self._buffer_bytes = buffer_bytes
        self._buffered_bytes = 0
        self._seq = 0
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.SNDHWM, 100_000)
        self._replay = self._ctx.socket(zmq.ROUTER) if replay_endpoint else None
        self._auth = None
        try:
            sockets = [self._pub] + ([self._replay] if self._replay else [])
            self._auth = kv_sockets.secure_publisher(self._ctx, sockets, curve_dir)
            self.endpoint = _bind(self._pub, endpoint)
            self.replay_endpoint = (
                _bind(self._replay, replay_endpoint) if self._replay and replay_endpoint else None
            )
        except ValueError:
            self._close_sockets()
            raise
        self._thread = threading.Thread(target=self._run, name="kvpilot-kv-events", daemon=True)
        self._thread.start()
        log.info(
            "KV events: PUB %s, replay %s, %s",
            self.endpoint,
            self.replay_endpoint or "off",
            "CURVE" if curve_dir else "unauthenticated (no --kv-events-curve-dir)",
        )

    # ---- engine side -----------------------------------------------------------------------------
    def flush(self) -> None:
        """Publish what the engine recorded since the last flush, as one batch (nothing if nothing)."""
        events = self.recorder.drain()
        if events:
            self._queue.put(EventBatch(time.time(), events, self.rank))

    def close(self, timeout: float = 2.0) -> None:
        self._queue.put(None)
        self._thread.join(timeout)

    def describe(self, reached_host: str | None) -> dict[str, Any]:
        """What GET /kv_events answers for a daemon with this one publisher."""
        ranks = [RankEndpoints(self.rank, self.endpoint, self.replay_endpoint, self.blocks_total)]
        return describe_ranks(
            ranks,
            reached_host,
            self.topic,
            self.recorder.block_size,
            self._buffer_batches,
            self._buffer_bytes,
            self.keys,
        )

    # ---- publisher thread ------------------------------------------------------------------------
    def _run(self) -> None:
        batch: EventBatch | _Idle | None
        try:
            while True:
                try:
                    batch = self._queue.get(timeout=0.02)
                except queue.Empty:
                    batch = _IDLE
                # Send everything queued before answering replays: a replay asked for after the daemon
                # answered (a reset, say) then covers every batch recorded before that answer.
                while batch is not _IDLE:
                    if batch is None:
                        return
                    self._send(batch)
                    try:
                        batch = self._queue.get_nowait()
                    except queue.Empty:
                        batch = _IDLE
                if self._replay is not None:
                    while self._replay.poll(0):
                        self._serve_replay()
        except Exception:  # noqa: BLE001 - events are advisory: the engine keeps serving without them
            log.exception("KV event publisher stopped")
        finally:
            self._close_sockets()

    def _send(self, batch: EventBatch) -> None:
        for payload in encode_batches(batch):
            seq = self._seq
            self._seq += 1
            self._buffer.append((seq, payload))
            self._buffered_bytes += len(payload)
            while self._buffer and (
                len(self._buffer) > self._buffer_batches or self._buffered_bytes > self._buffer_bytes
            ):
                self._buffered_bytes -= len(self._buffer.popleft()[1])
            self._pub.send_multipart((self._topic, seq.to_bytes(8, "big", signed=True), payload))

    def _serve_replay(self) -> None:
        assert self._replay is not None
        frames = self._replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            log.warning("ignored a malformed KV event replay request (%d frames)", len(frames))
            return
        client, _, start = frames
        start_seq = int.from_bytes(start, "big", signed=True)
        for seq, payload in list(self._buffer):
            if seq >= start_seq:
                self._replay.send_multipart(
                    (client, b"", self._topic, seq.to_bytes(8, "big", signed=True), payload)
                )
        self._replay.send_multipart((client, b"", b"", END_OF_REPLAY.to_bytes(8, "big", signed=True), b""))

    def _close_sockets(self) -> None:
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)
        if self._auth is not None:
            self._auth.stop()  # its socket is the context's too
        self._ctx.term()


@dataclass(frozen=True, slots=True)
class RankEndpoints:
    """Where one data-parallel rank publishes (as bound)."""

    rank: int
    endpoint: str
    replay_endpoint: str | None
    blocks_total: int | None = None  # the rank's KV pool and offload tiers, in blocks


def rank_endpoint(endpoint: str | None, rank: int) -> str | None:
    """Rank r of a data-parallel daemon publishes on the configured port + r, as vLLM's ranks do, so each
    has its own sockets and sequence numbers. Port 0 (any free port) stays 0: GET /kv_events names them."""
    if endpoint is None or rank == 0:
        return endpoint
    head, sep, port = endpoint.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"a KV events endpoint of a data-parallel daemon needs a TCP port: {endpoint}")
    return f"{head}:{int(port) + rank}" if int(port) else endpoint


def describe_ranks(
    ranks: list[RankEndpoints],
    reached_host: str | None,
    topic: str,
    block_size: int,
    buffer_batches: int,
    buffer_bytes: int,
    keys: KeyScheme,
) -> dict[str, Any]:
    """What GET /kv_events answers. `endpoint`, `replay_endpoint` and `blocks_total` are rank 0's (the
    reply of a single-rank daemon, which readers from before data parallelism use); `ranks` lists every
    rank's. A wildcard bind is named by the host the client reached. `buffer_batches` and `buffer_bytes`
    bound one rank's replay answer (its payloads' bytes)."""
    listed = []
    for r in ranks:
        replay = _connectable(r.replay_endpoint, reached_host) if r.replay_endpoint else None
        listed.append(
            {
                "rank": r.rank,
                "endpoint": _connectable(r.endpoint, reached_host),
                "replay_endpoint": replay,
                "blocks_total": r.blocks_total,
            }
        )
    return {
        "endpoint": listed[0]["endpoint"],
        "replay_endpoint": listed[0]["replay_endpoint"],
        "topic": topic,
        "format": "vllm",
        "block_size": block_size,
        **keys.describe(),
        "blocks_total": listed[0]["blocks_total"],
        "buffer_batches": buffer_batches,
        "buffer_bytes": buffer_bytes,
        "ranks": listed,
    }


def _bind(sock: zmq.SyncSocket, endpoint: str) -> str:
    host = endpoint.partition("://")[2].rpartition(":")[0]
    if ":" in host:
        # An IPv6 address (a pod's own on an IPv6 cluster): ZeroMQ refuses it unless told. Only then, since
        # with the option an IPv4 bind reports itself as [::ffff:a.b.c.d], which IPv4-only consumers cannot dial.
        sock.setsockopt(zmq.IPV6, 1)
    try:
        sock.bind(endpoint)
    except zmq.ZMQError as exc:
        raise ValueError(f"cannot bind the KV events endpoint {endpoint}: {exc}") from None
    return sock.getsockopt_string(zmq.LAST_ENDPOINT)


def _connectable(endpoint: str, reached_host: str | None) -> str:
    """tcp://0.0.0.0:5557 -> tcp://<host the client reached>:5557 (a bind address is not dialable)."""
    scheme, _, rest = endpoint.partition("://")
    host, sep, port = rest.rpartition(":")
    if scheme == "tcp" and sep and host in ("0.0.0.0", "*", "[::]", "::") and reached_host:
        host = f"[{reached_host}]" if ":" in reached_host else reached_host
        return f"tcp://{host}:{port}"
    return endpoint
