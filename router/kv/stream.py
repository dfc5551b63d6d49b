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

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from kvpilot.kv.events import (
    AllBlocksCleared,
    BlockStored,
    decode_batch,
)
from kvpilot.router.kv.index import PrefixIndex
from kvpilot.router.kv.loop_waker import LoopWaker, has_message
from kvpilot.router.kv.replay import (
    DEFAULT_REPLAY_LIMITS,
    ReplayChannel,
    ReplayError,
    ReplayLimits,
    fetch_replay,
    read_seq,
)
from kvpilot.router.kv.weight_versions import Version, checked

log = logging.getLogger(__name__)

# (pod, result, batches): result is "received", "replayed" or "missed"
CountFn = Callable[[str, str, int], None]


# How long a stream applies batches in a row before it lets the loop run other work (its own await may not
# yield). By time, not by count: with many pods flooding at once, one turn of the loop then takes at most
# pods x (this + one batch), where 32 batches each was every pod's whole backlog (16 ranks of 1M keys held
# /health for 7.9 s: bench/zero_trust.py).
YIELD_AFTER_S = 0.005
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
        limits: ReplayLimits = DEFAULT_REPLAY_LIMITS,
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
        self._runner: asyncio.Task[object] | None = None  # the task running `run`, whatever it returns
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

    def _subscribe(self) -> tuple[zmq.asyncio.Socket, zmq.asyncio.Socket, LoopWaker]:
        """A new SUB socket connected to the pod, its monitor (disconnections), and their waker."""
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.RCVHWM, 100_000)
        monitor = sub.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        sub.connect(self.endpoint)
        return sub, monitor, LoopWaker()

    @staticmethod
    def _unsubscribe(sub: zmq.asyncio.Socket, monitor: zmq.asyncio.Socket, waker: LoopWaker) -> None:
        waker.close()
        sub.disable_monitor()
        monitor.close()
        sub.close()

    async def run(self) -> None:
        sub, monitor, waker = self._subscribe()
        live, events_of_monitor = waker.watch(sub), waker.watch(monitor)
        if self.replay_endpoint is not None:
            self._runner = asyncio.current_task()
            self._channel = ReplayChannel(self._ctx, self.replay_endpoint, self.limits)
        try:
            await self._quiet_check()
            self.synced.set()
            loop = asyncio.get_running_loop()
            slice_start = loop.time()
            while True:
                waker.clear()
                if has_message(events_of_monitor):
                    parse_monitor_message(events_of_monitor.recv_multipart(zmq.NOBLOCK))
                    self.restart("connection to the pod dropped")
                    # A new socket, not disconnect() and connect() on this one: libzmq 4.3.5 then aborts
                    # the whole process (fq.cpp "!_more") when the pod restarts under load
                    # (tests/router/test_pod_restarts.py). Also after an oversized frame (MAXMSGSIZE), a
                    # protocol error after which libzmq never reconnects by itself.
                    self._unsubscribe(sub, monitor, waker)
                    sub, monitor, waker = self._subscribe()
                    live, events_of_monitor = waker.watch(sub), waker.watch(monitor)
                    continue
                if has_message(live):
                    frames = live.recv_multipart(zmq.NOBLOCK)
                    seq = read_seq(frames[1]) if len(frames) == 3 else None
                    if seq is None:
                        await self.on_gap("a malformed message")
                    else:
                        await self.on_message(seq, frames[2])
                    if loop.time() - slice_start >= YIELD_AFTER_S:
                        await asyncio.sleep(0)  # a backlog or a flooding pod never holds the loop
                        slice_start = loop.time()
                    continue
                woke = await waker.wait(self._idle_check_s)
                slice_start = loop.time()  # it waited: the loop ran other work
                if not woke:
                    checked = self._checked
                    if (
                        checked is None
                        or checked[0] != self._armed
                        or loop.time() - checked[1] > QUIET_RECHECK_S
                    ):
                        await self._quiet_check()  # quiet: make sure no last batch was lost
        finally:
            if self._channel is not None:
                self._channel.close()
            self._runner = self._channel = None
            self._unsubscribe(sub, monitor, waker)

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
        loop = asyncio.get_running_loop()
        slice_start = loop.time()
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
            if loop.time() - slice_start >= YIELD_AFTER_S:
                # An answer may hold 64 MiB of batches: applied in slices, as the live path applies its
                # backlog, so requests and probes are served meanwhile.
                await asyncio.sleep(0)
                slice_start = loop.time()
                if self.held or self.last_seq < seq:
                    return False  # held or started over meanwhile: what is left of this answer is stale
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
