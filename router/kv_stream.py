"""Follow one pod's KV events into the prefix index: live over SUB, gaps and restarts through replay.

Order of truth: batches are applied strictly in sequence order. A batch that arrives ahead of the next
expected one means batches were lost (ZeroMQ PUB drops under load): the missing range is fetched from the
pod's replay socket first. If the pod no longer buffers it (or has no replay socket), the pod's entries
are emptied and rebuilt from the next batch on, so the index never keeps a block the pod evicted.

The stream also catches up when idle (a lost last batch shows no gap until the next one arrives) and
starts over when its connection to the pod drops (the pod may have restarted with an empty cache and
sequence numbers from 0). A router that restarts rebuilds each pod's entries from the replay buffer.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from kvpilot.daemon.engine.kv_events import END_OF_REPLAY, decode_batch
from kvpilot.kv_sockets import reconnect
from kvpilot.router.index import PrefixIndex

log = logging.getLogger(__name__)

# (pod, result, batches): result is "received", "replayed" or "missed"
CountFn = Callable[[str, str, int], None]


async def fetch_replay(
    ctx: zmq.asyncio.Context, replay_endpoint: str, start_seq: int, timeout: float = 2.0
) -> list[tuple[int, bytes]] | None:
    """Every batch the publisher still buffers from `start_seq` on, as (seq, payload); None if it does
    not answer within `timeout` per message."""
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(replay_endpoint)
    out: list[tuple[int, bytes]] = []
    try:
        await sock.send_multipart([b"", start_seq.to_bytes(8, "big", signed=True)])
        while True:
            if not await sock.poll(int(timeout * 1000)):
                return None
            frames = await sock.recv_multipart()
            # [empty delimiter, topic, seq, payload] (vLLM); SGLang-style replies omit the topic.
            seq_frame, payload = frames[-2], frames[-1]
            seq = int.from_bytes(seq_frame, "big", signed=True)
            if seq == END_OF_REPLAY:
                return out
            out.append((seq, payload))
    finally:
        sock.close()


class PodEventStream:
    """One publisher (one pod rank), indexed as the holder (pod, rank). `run()` until cancelled."""

    def __init__(
        self,
        pod: str,
        endpoint: str,
        replay_endpoint: str | None,
        index: PrefixIndex,
        count: CountFn,
        ctx: zmq.asyncio.Context,
        idle_check_s: float = 1.0,
        rank: int = 0,
    ) -> None:
        self.pod = pod
        self.rank = rank
        self.key = (pod, rank)
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.index = index
        self._count = count
        self._ctx = ctx
        self._idle_check_s = idle_check_s
        self.last_seq = -1  # highest sequence applied
        self.synced = asyncio.Event()  # set once the initial replay is applied

    async def run(self) -> None:
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.RCVHWM, 100_000)
        monitor = sub.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        sub.connect(self.endpoint)
        poller = zmq.asyncio.Poller()
        poller.register(sub, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        try:
            await self.catch_up()
            self.synced.set()
            while True:
                ready = dict(await poller.poll(int(self._idle_check_s * 1000)))
                if monitor in ready:
                    parse_monitor_message(await monitor.recv_multipart())
                    self.restart("connection to the pod dropped")
                    reconnect(sub, self.endpoint)  # also after an oversized frame (MAXMSGSIZE)
                if sub in ready:
                    frames = await sub.recv_multipart()
                    if len(frames) == 3:
                        await self.on_message(int.from_bytes(frames[1], "big", signed=True), frames[2])
                if not ready:
                    await self.catch_up()  # quiet: make sure no last batch was lost
        finally:
            sub.disable_monitor()
            monitor.close()
            sub.close()

    def restart(self, why: str) -> None:
        """Forget the pod's entries and take its stream from the start (what replay still holds)."""
        log.info("KV events of %s rank %d: starting over (%s)", self.pod, self.rank, why)
        self.index.clear(self.key)
        self.last_seq = -1

    async def on_message(self, seq: int, payload: bytes) -> None:
        """A live batch. Batches the pod sent before it are applied first (from replay)."""
        self._count(self.pod, "received", 1)
        if seq <= self.last_seq:
            return  # already applied through replay
        if seq > self.last_seq + 1:
            await self.catch_up(until=seq)
            if seq <= self.last_seq:
                return  # a concurrent catch-up (a fleet reset's) applied it meanwhile
        if seq > self.last_seq + 1:  # still missing: the pod no longer has them
            self._count(self.pod, "missed", seq - self.last_seq - 1)
            self.restart(f"batches {self.last_seq + 1}..{seq - 1} are lost")
        self._apply(seq, payload)

    async def catch_up(self, until: int | None = None) -> bool:
        """Apply buffered batches after `last_seq` (up to `until`, exclusive) from the replay socket.
        Without `until`, that is every batch the pod had sent when it answered. False if it did not."""
        if self.replay_endpoint is None:
            return False
        start = self.last_seq + 1
        got = await fetch_replay(self._ctx, self.replay_endpoint, start)
        if got is None:
            log.warning("KV events of %s: replay did not answer", self.pod)
            return False
        if got and got[0][0] > start:
            if self.last_seq >= 0:  # a hole in what we applied (at startup, older history is just gone)
                self._count(self.pod, "missed", got[0][0] - start)
                self.restart(f"replay starts at {got[0][0]}, after {start}")
            self.last_seq = got[0][0] - 1  # the stream is taken from the oldest buffered batch
        for seq, payload in got:
            if until is not None and seq >= until:
                break
            if seq > self.last_seq:
                self._count(self.pod, "replayed", 1)
                self._apply(seq, payload)
        return True

    def _apply(self, seq: int, payload: bytes) -> None:
        try:
            batch = decode_batch(payload)
        except ValueError as exc:
            log.warning("KV events of %s: batch %d unreadable (%s); starting over", self.pod, seq, exc)
            self.restart("unreadable batch")
            self.last_seq = seq
            return
        self.index.apply(self.key, batch)
        self.last_seq = seq
