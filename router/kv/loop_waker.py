"""Waking a task on its ZeroMQ sockets from the event loop's own descriptor watch, instead of pyzmq's
asyncio poller: kept in this one module because it leans on how libzmq signals, which a pyzmq or libzmq
upgrade may change.

Why it is kept: woken here (`LoopWaker` says what pyzmq's asyncio poller costs), a KV event
batch cost the router 435 µs of CPU instead of 540 (-19%, publisher in another process, on a busy machine:
docs/performance.md, "Event sockets woken by their descriptors", bench/router_compare.py), more than the
10% within which the public API would have replaced it. What it leans on: pyzmq's
`Socket.shadow(sock.underlying)` (a plain socket on the same libzmq socket as the asyncio one, so pyzmq's
poller never runs for it), `Socket.FD` and `zmq.EVENTS`, all public; and how libzmq signals behind them,
which its manual describes only loosely: the descriptor turns readable when a socket's state changes
(edge, not level: a message already waiting signals nothing more), and reading `EVENTS` quiets it, so a
level-triggered loop (asyncio's and uvloop's `add_reader`) does not call `_wake` again and again.
Verified on pyzmq 27.3.0 with libzmq 4.3.5 (asyncio and uvloop 0.23.0, CPython 3.11). The guard,
tests/test_framework_guards.py (`test_loop_waker_*`), fails on a version that changes any of these, naming
it; tests/router/test_kv_events.py fails too if it stops waking."""

from __future__ import annotations

import asyncio
from typing import cast

import zmq
import zmq.asyncio


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

    def watch(self, sock: zmq.asyncio.Socket) -> zmq.SyncSocket:
        """Wake on `sock` from now on; returns it as a plain (blocking-API) socket, read with NOBLOCK."""
        plain: zmq.SyncSocket = zmq.Socket.shadow(sock.underlying)
        self._fds.append(plain.FD)
        self._loop.add_reader(plain.FD, self._wake, plain)
        return plain

    def _wake(self, sock: zmq.SyncSocket) -> None:
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


# As plain ints: `int & zmq.POLLIN` goes through the enum's Python `__rand__` (2.3 us a check, against 1.5),
# and the event loop checks its sockets four times or more per KV event batch.
_EVENTS, _POLLIN = int(zmq.EVENTS), int(zmq.POLLIN)


def has_message(sock: zmq.SyncSocket) -> bool:
    return bool(cast(int, sock.get(_EVENTS)) & _POLLIN)  # EVENTS is an int option
