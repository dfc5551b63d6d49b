"""A pod rank's replay socket, asked for the KV event batches a stream missed: each answer bounded in batches
and bytes (the pod's advertised buffer) and in time (silence and total), or refused (`ReplayError`); a
sequence frame that is not 8 bytes or not in [0, 2**62) is no batch. The stream that asks is stream.py's."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

import zmq
import zmq.asyncio

from kvpilot.kv.events import (
    DEFAULT_BUFFER_BATCHES,
    DEFAULT_BUFFER_BYTES,
    END_OF_REPLAY,
)
from kvpilot.router.kv.loop_waker import LoopWaker, has_message

log = logging.getLogger(__name__)

# A counter that grows by one per engine step never gets near it; at or above it a sequence number is a
# lie (and one past 2**63-1 no longer fits the 8-byte frame).
MAX_SEQ = 1 << 62
_END_FRAME = END_OF_REPLAY.to_bytes(8, "big", signed=True)


@dataclass(frozen=True, slots=True)
class ReplayLimits:
    """What one replay answer may be: the pod's advertised buffer, and how long it may take."""

    batches: int = DEFAULT_BUFFER_BATCHES
    bytes: int = DEFAULT_BUFFER_BYTES  # of the payloads together
    silence_s: float = 2.0  # nothing for this long: the pod does not answer
    total_s: float = 10.0  # the whole answer, however it trickles


DEFAULT_REPLAY_LIMITS = ReplayLimits()  # what a pod that advertises no buffer of its own keeps


class ReplayError(Exception):
    """The replay socket gave no complete, well-formed answer within its limits."""


def read_seq(frame: bytes) -> int | None:
    """A batch's sequence number; None unless the frame is 8 bytes holding a value in [0, MAX_SEQ)."""
    if len(frame) != 8:
        return None
    seq = int.from_bytes(frame, "big", signed=True)
    return seq if 0 <= seq < MAX_SEQ else None


async def fetch_replay(
    ctx: zmq.asyncio.Context,
    replay_endpoint: str,
    start_seq: int,
    limits: ReplayLimits = DEFAULT_REPLAY_LIMITS,
) -> list[tuple[int, bytes]]:
    """Every batch the publisher still buffers from `start_seq` on, as (seq, payload), over a connection of
    its own. Raises ReplayError when the answer breaks `limits` or is malformed (what came so far is
    dropped)."""
    channel = ReplayChannel(ctx, replay_endpoint, limits)
    try:
        return await channel.fetch(start_seq)
    finally:
        channel.close()


class ReplayChannel:
    """A rank's replay socket, kept connected from one request to the next, for one task (a stream's run)
    to ask in turn. A stream asks whenever it goes quiet after a burst: a new connection each time (the
    TCP and ZeroMQ handshakes, CURVE's key exchange, on both sides) cost more router CPU than the requests
    that made the burst (bench/router_compare.py), while one round trip on an open one costs little. After
    a failed or abandoned answer the socket is dropped, so nothing it still sends is read as the answer to
    the next request (the next one connects anew, under a new identity)."""

    def __init__(
        self, ctx: zmq.asyncio.Context, endpoint: str, limits: ReplayLimits = DEFAULT_REPLAY_LIMITS
    ) -> None:
        self._ctx = ctx
        self.endpoint = endpoint
        self.limits = limits
        self._owned: zmq.asyncio.Socket | None = None  # the socket itself (which closes when collected)
        self._sock: zmq.SyncSocket | None = None  # the same, read from the loop (LoopWaker)
        self._waker: LoopWaker | None = None

    async def fetch(self, start_seq: int) -> list[tuple[int, bytes]]:
        """Every batch the publisher still buffers from `start_seq` on (see fetch_replay)."""
        if self._sock is None or self._waker is None:
            self._owned = self._ctx.socket(zmq.DEALER)
            self._owned.setsockopt(zmq.LINGER, 0)
            try:
                self._owned.connect(self.endpoint)
            except zmq.ZMQError as exc:  # an address libzmq refuses: a failed replay, as any other
                self.close()
                raise ReplayError(f"{self.endpoint} cannot be connected to ({exc})") from None
            self._waker = LoopWaker()
            self._sock = self._waker.watch(self._owned)
        try:
            return await self._read_answer(self._sock, self._waker, start_seq)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        if self._waker is not None:
            self._waker.close()
        if self._owned is not None:
            self._owned.close()
        self._owned = self._sock = self._waker = None

    async def _read_answer(
        self, sock: zmq.SyncSocket, waker: LoopWaker, start_seq: int
    ) -> list[tuple[int, bytes]]:
        limits = self.limits
        loop = asyncio.get_running_loop()
        deadline = loop.time() + limits.total_s
        out: list[tuple[int, bytes]] = []
        size = 0
        try:  # never waits: the socket is connected (or connecting), so DEALER queues the request
            sock.send_multipart([b"", start_seq.to_bytes(8, "big", signed=True)], zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            raise ReplayError(f"the request could not be sent ({exc})") from None
        while True:
            waker.clear()
            if not has_message(sock):
                wait = min(limits.silence_s, deadline - loop.time())
                if wait <= 0:
                    raise ReplayError(f"no complete answer within {limits.total_s:g} s")
                if not await waker.wait(wait):
                    if wait < limits.silence_s:
                        continue  # the deadline: said on the next turn
                    raise ReplayError(f"no answer for {limits.silence_s:g} s")
                continue
            frames = sock.recv_multipart(zmq.NOBLOCK)
            # [empty delimiter, topic, seq, payload] (vLLM); SGLang-style replies omit the topic.
            if len(frames) < 2:
                raise ReplayError(f"a message of {len(frames)} frames")
            if frames[-2] == _END_FRAME:
                return out
            seq = read_seq(frames[-2])
            if seq is None:
                raise ReplayError("a sequence frame that is no number in [0, 2**62)")
            size += len(frames[-1])
            if len(out) >= limits.batches or size > limits.bytes:
                raise ReplayError(f"more than its buffer ({limits.batches} batches, {limits.bytes} bytes)")
            out.append((seq, frames[-1]))
