"""Follow one pod's KV events into the prefix index: live over SUB, gaps and restarts through replay.

Order of truth: batches are applied strictly in sequence order. A batch that arrives ahead of the next
expected one means batches were lost (ZeroMQ PUB drops under load): the missing range is fetched from the
pod's replay socket first. If the pod no longer buffers it (or has no replay socket), the pod's entries
are emptied and rebuilt from the next batch on, so the index never keeps a block the pod evicted.

The stream also catches up when it goes quiet, then every 30 s of quiet (a lost last batch shows no gap
until the next one arrives), and starts over when its connection to the pod drops (the pod may have
restarted with an empty cache and sequence numbers from 0). A router that restarts rebuilds each pod's entries from the replay buffer.

Each stream also knows the rank's weight version (`weight_versions.py`): the pod's /health names it when
the stream starts (and when it starts over), and an `AllBlocksCleared` that names a version sets it at
that point of the stream; a plain one (a reset) leaves it. Two probes in a row naming another version win
(the pod restarted on other weights between two probes, its events naming none).

Nothing a pod sends can stall or exhaust the router: a replay answer is bounded in batches and bytes (the
pod's advertised buffer, `kv/info.py`) and in time (silence and total), or it is refused; a message whose
sequence frame is not 8 bytes or not in [0, 2**62) is a gap (caught up through replay, else the pod's
entries start over), never an exception; an unreadable batch starts the pod over.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import cast

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from kvpilot.kv.events import (
    DEFAULT_BUFFER_BATCHES,
    DEFAULT_BUFFER_BYTES,
    END_OF_REPLAY,
    AllBlocksCleared,
    BlockStored,
    decode_batch,
)
from kvpilot.kv.sockets import reconnect
from kvpilot.router.kv.index import PrefixIndex
from kvpilot.router.kv.weight_versions import Version, checked

log = logging.getLogger(__name__)

# (pod, result, batches): result is "received", "replayed" or "missed"
CountFn = Callable[[str, str, int], None]
# A counter that grows by one per engine step never gets near it; at or above it a sequence number is a
# lie (and one past 2**63-1 no longer fits the 8-byte frame).
MAX_SEQ = 1 << 62


@dataclass(frozen=True, slots=True)
class ReplayLimits:
    """What one replay answer may be: the pod's advertised buffer, and how long it may take."""

    batches: int = DEFAULT_BUFFER_BATCHES
    bytes: int = DEFAULT_BUFFER_BYTES  # of the payloads together
    silence_s: float = 2.0  # nothing for this long: the pod does not answer
    total_s: float = 10.0  # the whole answer, however it trickles


class ReplayError(Exception):
    """The replay socket gave no complete, well-formed answer within its limits."""


def read_seq(frame: bytes) -> int | None:
    """A batch's sequence number; None unless the frame is 8 bytes holding a value in [0, MAX_SEQ)."""
    if len(frame) != 8:
        return None
    seq = int.from_bytes(frame, "big", signed=True)
    return seq if 0 <= seq < MAX_SEQ else None


async def fetch_replay(
    ctx: zmq.asyncio.Context, replay_endpoint: str, start_seq: int, limits: ReplayLimits = ReplayLimits()
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
        self, ctx: zmq.asyncio.Context, endpoint: str, limits: ReplayLimits = ReplayLimits()
    ) -> None:
        self._ctx = ctx
        self.endpoint = endpoint
        self.limits = limits
        self._owned: zmq.asyncio.Socket | None = None  # the socket itself (which closes when collected)
        self._sock: zmq.Socket | None = None  # the same, read from the loop (LoopWaker)
        self._waker: LoopWaker | None = None

    async def fetch(self, start_seq: int) -> list[tuple[int, bytes]]:
        """Every batch the publisher still buffers from `start_seq` on (see fetch_replay)."""
        if self._sock is None or self._waker is None:
            self._owned = self._ctx.socket(zmq.DEALER)
            self._owned.setsockopt(zmq.LINGER, 0)
            self._owned.connect(self.endpoint)
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
        self, sock: zmq.Socket, waker: LoopWaker, start_seq: int
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


class LoopWaker:
    """Wakes a task when one of its ZeroMQ sockets may hold a message: the sockets' descriptors are watched
    by the event loop itself, not by pyzmq's asyncio poller, which cost ~0.3 ms of CPU a wait (its futures,
    a zmq_poll and a reader registered anew on each call: most of what the router spent per request on
    events, bench/router_compare.py). Like every ZeroMQ descriptor they are edge-triggered: the task calls
    `clear()`, then reads each socket while `has_message`, and waits only once none holds one."""

    def __init__(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._woken = asyncio.Event()
        self._fds: list[int] = []

    def watch(self, sock: zmq.Socket) -> zmq.Socket:
        """Wake on `sock` from now on; returns it as a plain (blocking-API) socket, read with NOBLOCK."""
        plain: zmq.Socket = zmq.Socket.shadow(sock.underlying)
        self._fds.append(plain.FD)
        self._loop.add_reader(plain.FD, self._wake, plain)
        return plain

    def _wake(self, sock: zmq.Socket) -> None:
        # Reading EVENTS takes in what libzmq signalled, which quiets the descriptor: without it the
        # loop, level-triggered, would call this again and again while the task awaits something else.
        sock.get(zmq.EVENTS)
        self._woken.set()

    def clear(self) -> None:
        self._woken.clear()

    async def wait(self, timeout_s: float) -> bool:
        """True once woken since `clear()`; False after `timeout_s` without."""
        try:
            async with asyncio.timeout(timeout_s):
                await self._woken.wait()
        except TimeoutError:
            return False
        return True

    def close(self) -> None:
        for fd in self._fds:
            self._loop.remove_reader(fd)
        self._fds.clear()


def has_message(sock: zmq.Socket) -> bool:
    return bool(cast(int, sock.get(zmq.EVENTS)) & zmq.POLLIN)  # EVENTS is an int option


_END_FRAME = END_OF_REPLAY.to_bytes(8, "big", signed=True)


# Batches a stream applies in a row before it lets the loop run other work (its own await may not yield).
YIELD_EVERY = 32
QUIET_RECHECK_S = 30.0  # a stream quiet since its last complete replay check is checked again this often


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
        limits: ReplayLimits = ReplayLimits(),
        blocks_total: int | None = None,
        weight_version: Version = None,
        on_version: Callable[[Version], None] = lambda version: None,
        block_size: int | None = None,
    ) -> None:
        self._on_version = on_version  # told each version the rank serves from then on (VersionChoice.saw)
        self.pod = pod
        self.rank = rank
        self.key = (pod, rank)
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.index = index
        self._count = count
        self._ctx = ctx
        self._idle_check_s = idle_check_s
        self.limits = limits
        # The block size the router keys this pod's prompts with: a BlockStored of another size names
        # blocks no request's keys can meet (a vLLM pod's --block-size is not published: the router is
        # told it), which is said once, not per batch.
        self.block_size = block_size
        self._size_warned = False
        self.last_seq = -1  # highest sequence applied
        # What the rank's keys are hashed with: the pod's /health at first (the fleet keeps `health_version`
        # current), then each AllBlocksCleared that names one, applied where it stands in the stream.
        self.health_version: Version = weight_version
        self._weight_version: Version = weight_version
        self._disagreed = False  # the last /health named another version than the events
        # The pod is not ready: its entries are gone and nothing is applied (not even from replay, which
        # the idle check would otherwise do within a second) until it is back (`hold`, `release`).
        self.held = False
        self.synced = asyncio.Event()  # set once the initial replay is applied
        # A quiet stream is checked against replay once, then every QUIET_RECHECK_S, not every idle second:
        # each check is a new ZeroMQ connection to the pod, which cost an idle router 2-3 ms of CPU a
        # second for two pods (bench/router_compare.py). A batch, a restart or a release arms the check
        # again (`_armed` counts them); a check counts only if nothing armed it meanwhile, and a failed
        # one is retried at the next idle tick.
        self._armed = 0
        self._checked: tuple[int, float] | None = None  # (_armed, loop time) of the last complete check
        self._replay_error = ""  # the last replay failure, logged once until it changes
        # The run task's own replay connection (`ReplayChannel`); anyone else catching up (a fleet reset)
        # asks over a connection of its own, so two answers never share a socket.
        self._runner: asyncio.Task | None = None
        self._channel: ReplayChannel | None = None
        index.set_capacity(self.key, blocks_total)

    @property
    def weight_version(self) -> Version:
        return self._weight_version

    @weight_version.setter
    def weight_version(self, version: Version) -> None:
        if version != self._weight_version:
            self._on_version(version)
        self._weight_version = version

    async def run(self) -> None:
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.RCVHWM, 100_000)
        monitor = sub.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        sub.connect(self.endpoint)
        waker = LoopWaker()
        live, events_of_monitor = waker.watch(sub), waker.watch(monitor)
        if self.replay_endpoint is not None:
            self._runner = asyncio.current_task()
            self._channel = ReplayChannel(self._ctx, self.replay_endpoint, self.limits)
        try:
            await self._quiet_check()
            self.synced.set()
            in_a_row = 0
            while True:
                waker.clear()
                if has_message(events_of_monitor):
                    parse_monitor_message(events_of_monitor.recv_multipart(zmq.NOBLOCK))
                    self.restart("connection to the pod dropped")
                    reconnect(sub, self.endpoint)  # also after an oversized frame (MAXMSGSIZE)
                    continue
                if has_message(live):
                    frames = live.recv_multipart(zmq.NOBLOCK)
                    seq = read_seq(frames[1]) if len(frames) == 3 else None
                    if seq is None:
                        await self.on_gap("a malformed message")
                    else:
                        await self.on_message(seq, frames[2])
                    in_a_row += 1
                    if in_a_row % YIELD_EVERY == 0:
                        await asyncio.sleep(0)  # a backlog or a flooding pod never holds the loop
                    continue
                in_a_row = 0
                if not await waker.wait(self._idle_check_s):
                    checked = self._checked
                    if (
                        checked is None
                        or checked[0] != self._armed
                        or asyncio.get_running_loop().time() - checked[1] > QUIET_RECHECK_S
                    ):
                        await self._quiet_check()  # quiet: make sure no last batch was lost
        finally:
            if self._channel is not None:
                self._channel.close()
            self._runner = self._channel = None
            waker.close()
            sub.disable_monitor()
            monitor.close()
            sub.close()

    async def _quiet_check(self) -> None:
        armed = self._armed
        if await self.catch_up() and armed == self._armed:
            self._checked = (armed, asyncio.get_running_loop().time())

    def health_says(self, version: Version) -> None:
        """The pod's /health named `version`. The events decide, but two probes in a row that say
        otherwise win: the pod restarted on other weights between two probes (one probe that straddles a
        swap disagrees once)."""
        disagrees = version != self.weight_version
        if disagrees and self._disagreed and version == self.health_version:
            log.info(
                "KV events of %s rank %d: weight version %r, as /health says", self.pod, self.rank, version
            )
            self.weight_version = version
            disagrees = False
        self._disagreed = disagrees
        self.health_version = version

    def restart(self, why: str) -> None:
        """Forget the pod's entries and take its stream from the start (what replay still holds)."""
        log.info("KV events of %s rank %d: starting over (%s)", self.pod, self.rank, why)
        self.index.clear(self.key)
        self.last_seq = -1
        self._armed += 1
        self.weight_version = self.health_version  # the pod may have restarted on other weights

    def hold(self, why: str) -> None:
        """The pod stopped being ready: forget its entries and apply nothing until `release`."""
        if not self.held:
            self.restart(why)
            self.held = True

    def release(self) -> None:
        """The pod is ready again: its entries are rebuilt from replay (the next message or idle check)."""
        if self.held:  # (the fleet releases a ready pod's streams at every probe)
            self.held = False
            self._armed += 1

    async def on_message(self, seq: int, payload: bytes) -> None:
        """A live batch. Batches the pod sent before it are applied first (from replay)."""
        self._count(self.pod, "received", 1)
        self._armed += 1
        if self.held:
            return
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

    def _wrong_block_size(self, stored: int) -> None:
        if self._size_warned or self.block_size is None:
            return
        self._size_warned = True
        log.warning(
            "KV events of %s rank %d store blocks of %r tokens, but the router keys its prompts in blocks of "
            "%d (a vLLM pod's --block-size, given to the router as --kv-events-block-size): no request "
            "will find this pod's prefixes",
            self.pod,
            self.rank,
            stored,
            self.block_size,
        )

    async def on_gap(self, why: str) -> None:
        """A live message without a usable sequence number: whatever it was, the replay has it, or the
        pod's entries start over."""
        self._count(self.pod, "received", 1)
        if not await self.catch_up():
            self._count(self.pod, "missed", 1)
            self.restart(why)

    async def catch_up(self, until: int | None = None) -> bool:
        """Apply buffered batches after `last_seq` (up to `until`, exclusive) from the replay socket.
        Without `until`, that is every batch the pod had sent when it answered. False if it did not."""
        if self.held:
            return True  # nothing is applied while the pod is not ready: nothing to catch up on
        if self.replay_endpoint is None:
            return False
        try:
            if self._channel is not None and asyncio.current_task() is self._runner:
                got = await self._channel.fetch(self.last_seq + 1)
            else:
                got = await fetch_replay(self._ctx, self.replay_endpoint, self.last_seq + 1, self.limits)
        except ReplayError as exc:
            if str(exc) != self._replay_error:  # once per reason: a dead pod fails every idle check
                log.warning("KV events of %s rank %d: replay failed (%s)", self.pod, self.rank, exc)
            self._replay_error = str(exc)
            return False
        self._replay_error = ""
        for seq, payload in got:
            if until is not None and seq >= until:
                break
            if seq <= self.last_seq:
                continue  # applied meanwhile (live, or by a concurrent catch-up)
            if seq > self.last_seq + 1:
                if self.last_seq >= 0:  # a hole in what we applied (at startup, older history is just gone)
                    self._count(self.pod, "missed", seq - self.last_seq - 1)
                    self.restart(f"replay has {seq} next, after {self.last_seq}")
                self.last_seq = seq - 1  # the stream is taken from the oldest buffered batch
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
        for ev in batch.events:
            if isinstance(ev, AllBlocksCleared) and ev.weight_version is not None:  # a plain one: a reset
                self.weight_version = checked(ev.weight_version)
            elif isinstance(ev, BlockStored) and ev.block_size != self.block_size:
                self._wrong_block_size(ev.block_size)
        self.last_seq = seq
