"""KV cache events: what entered and left the prefix index, published the way vLLM publishes them.

Consumers written for vLLM (llm-d's KV cache indexer, Dynamo's KV router, `kvpilot router`) read them
unchanged. The wire format is vLLM's (`vllm.distributed.kv_events`):

- One ZeroMQ PUB message per engine step that changed the index: three frames `(topic, seq, payload)`,
  `seq` an 8-byte big-endian counter that grows by one per message, so a consumer sees any gap.
- `payload` is msgpack: `[ts, events, data_parallel_rank]`, each event an array whose first element is
  its tag: `["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium,
  lora_name]`, `["BlockRemoved", block_hashes, medium]`, `["AllBlocksCleared"]` (after a weight update
  `["AllBlocksCleared", weight_version]`: the version the keys that follow are computed with).
- Block hashes are the engine's own prefix keys (32-byte sha256 digests, `block_hash.py`), so a router
  that hashes a request's tokens with that module finds them. Only full blocks are published.
- Replay (what vLLM's stream lacks in practice: its buffer is rarely enabled): a ROUTER socket answers a
  request frame holding an 8-byte start sequence with every buffered message from there, each as
  `(topic, seq, payload)`, then `(b"", seq=-1, b"")`. A consumer that missed messages catches up instead
  of guessing; one that restarts rebuilds its index from the buffer.

The engine records events while it schedules (on its own thread, no I/O) and hands one batch per step to
the publisher thread, which owns the sockets. With events off, the pool holds no recorder and nothing
here runs.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import msgpack
import zmq

from kvpilot.daemon.engine.block_hash import BlockHash

log = logging.getLogger(__name__)

END_OF_REPLAY = -1
_IDLE = object()  # the publisher thread found nothing queued
HASH_SCHEME = "sha256-chained/kvpilot-prefix-v1"  # names block_hash.py's keys for consumers
DEFAULT_BUFFER_BATCHES = 10_000  # batches a replay socket can serve again


# ---- events (vLLM's tagged array layout) -------------------------------------------------------
@dataclass(slots=True)
class BlockStored:
    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[int]
    block_size: int

    def wire(self) -> list:
        # lora_id, medium, lora_name: kvpilot has no LoRA; None medium is the engine's own KV pool.
        return [
            "BlockStored",
            self.block_hashes,
            self.parent_block_hash,
            self.token_ids,
            self.block_size,
            None,
            None,
            None,
        ]


@dataclass(slots=True)
class BlockRemoved:
    block_hashes: list[BlockHash]

    def wire(self) -> list:
        return ["BlockRemoved", self.block_hashes, None]


@dataclass(slots=True)
class AllBlocksCleared:
    weight_version: str | None = None  # named weights: every later key is hashed with this version

    def wire(self) -> list:
        return (
            ["AllBlocksCleared"] if self.weight_version is None else ["AllBlocksCleared", self.weight_version]
        )


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(slots=True)
class EventBatch:
    ts: float
    events: list[KVEvent]
    data_parallel_rank: int = 0


def encode_batch(batch: EventBatch) -> bytes:
    return msgpack.packb([batch.ts, [e.wire() for e in batch.events], batch.data_parallel_rank])


def decode_batch(payload: bytes) -> EventBatch:
    """Parse one payload (ours or vLLM's: integer hashes and missing trailing fields are accepted).
    Raises ValueError for anything that is not an event batch."""
    try:
        raw = msgpack.unpackb(payload, raw=False)
        ts, wire_events = raw[0], raw[1]
        rank = raw[2] if len(raw) > 2 and raw[2] is not None else 0
        events: list[KVEvent] = []
        for ev in wire_events:
            tag = ev[0]
            if tag == "BlockStored":
                events.append(BlockStored(list(ev[1]), ev[2], list(ev[3]), int(ev[4])))
            elif tag == "BlockRemoved":
                events.append(BlockRemoved(list(ev[1])))
            elif tag == "AllBlocksCleared":
                events.append(AllBlocksCleared(ev[1] if len(ev) > 1 else None))
            else:
                raise ValueError(f"unknown KV event {tag!r}")
        return EventBatch(float(ts), events, int(rank))
    except (msgpack.UnpackException, ValueError, TypeError, IndexError, KeyError) as exc:
        raise ValueError(f"not a KV event batch: {exc}") from None


# ---- recording (engine thread) -----------------------------------------------------------------
@dataclass(slots=True)
class KVEventRecorder:
    """Collects one step's events in order; the block pool and the cache manager call it."""

    block_size: int
    events: list[KVEvent] = field(default_factory=list)
    weight_version: str | None = None  # the named weights' version, told with each AllBlocksCleared

    def block_stored(self, chain: list[BlockHash], i: int, token_ids: list[int]) -> None:
        """Block `i` of a request whose keys are `chain` was indexed; consecutive blocks of one chain
        stored in the same step travel as one BlockStored, as in vLLM."""
        bs = self.block_size
        tokens = token_ids[i * bs : (i + 1) * bs]
        parent = chain[i - 1] if i > 0 else None
        last = self.events[-1] if self.events else None
        if isinstance(last, BlockStored) and parent is not None and last.block_hashes[-1] == parent:
            last.block_hashes.append(chain[i])
            last.token_ids.extend(tokens)
        else:
            self.events.append(BlockStored([chain[i]], parent, list(tokens), bs))

    def block_removed(self, block_hash: BlockHash) -> None:
        last = self.events[-1] if self.events else None
        if isinstance(last, BlockRemoved):
            last.block_hashes.append(block_hash)
        else:
            self.events.append(BlockRemoved([block_hash]))

    def all_cleared(self) -> None:
        self.events.append(AllBlocksCleared(self.weight_version))

    def drain(self) -> list[KVEvent]:
        out, self.events = self.events, []
        return out


# ---- publishing (its own thread: owns the sockets) ---------------------------------------------
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
    ) -> None:
        self.recorder = KVEventRecorder(block_size)
        self.rank = rank
        self.topic = topic
        self._topic = topic.encode()
        self._queue: queue.SimpleQueue[EventBatch | None] = queue.SimpleQueue()
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_batches)
        self._seq = 0
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.SNDHWM, 100_000)
        self._replay = self._ctx.socket(zmq.ROUTER) if replay_endpoint else None
        try:
            self.endpoint = _bind(self._pub, endpoint)
            self.replay_endpoint = _bind(self._replay, replay_endpoint) if self._replay else None
        except ValueError:
            self._close_sockets()
            raise
        self._thread = threading.Thread(target=self._run, name="kvpilot-kv-events", daemon=True)
        self._thread.start()
        log.info("KV events: PUB %s, replay %s", self.endpoint, self.replay_endpoint or "off")

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
        ranks = [RankEndpoints(self.rank, self.endpoint, self.replay_endpoint)]
        return describe_ranks(ranks, reached_host, self.topic, self.recorder.block_size, self._buffer.maxlen)

    # ---- publisher thread ------------------------------------------------------------------------
    def _run(self) -> None:
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
        payload = encode_batch(batch)
        seq = self._seq
        self._seq += 1
        self._buffer.append((seq, payload))
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
        self._ctx.term()


@dataclass(frozen=True, slots=True)
class RankEndpoints:
    """Where one data-parallel rank publishes (as bound)."""

    rank: int
    endpoint: str
    replay_endpoint: str | None


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
    buffer_batches: int | None,
) -> dict[str, Any]:
    """What GET /kv_events answers. `endpoint` and `replay_endpoint` are rank 0's (the reply of a
    single-rank daemon, which readers from before data parallelism use); `ranks` lists every rank's.
    A wildcard bind is named by the host the client reached."""
    listed = []
    for r in ranks:
        replay = _connectable(r.replay_endpoint, reached_host) if r.replay_endpoint else None
        listed.append(
            {"rank": r.rank, "endpoint": _connectable(r.endpoint, reached_host), "replay_endpoint": replay}
        )
    return {
        "endpoint": listed[0]["endpoint"],
        "replay_endpoint": listed[0]["replay_endpoint"],
        "topic": topic,
        "format": "vllm",
        "block_size": block_size,
        "block_hash": HASH_SCHEME,
        "buffer_batches": buffer_batches,
        "ranks": listed,
    }


def _bind(sock: zmq.Socket, endpoint: str) -> str:
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
