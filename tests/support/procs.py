"""Free ports and child processes for tests, on the dev cluster's devcluster.procs: every process a test starts
runs in its own process group, and whatever a test left running is stopped, group and all, when the
session ends."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable, Iterator
from typing import TypeVar

import pytest

from devcluster.procs import free_port, spawn, stop, stop_all, wait_ready

T = TypeVar("T")

__all__ = ["free_port", "free_port_run", "settled", "spawn", "stop", "wait_ready", "wait_for"]


def free_port_run(count: int) -> int:
    """A free port P with the `count - 1` ports after it free too: a data-parallel server binds rank r's
    socket at P + r."""
    while True:
        p = free_port()
        try:
            for i in range(1, count):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", p + i))
        except OSError:
            continue
        return p


def wait_for(check: Callable[[], object], timeout: float, what: str, interval: float = 0.25) -> object:
    """Poll `check` until it returns something truthy; fail the test with `what` otherwise."""
    deadline = time.monotonic() + timeout
    last_error: Exception | None = None
    while time.monotonic() < deadline:
        try:
            value = check()
            if value:
                return value
        except Exception as e:  # noqa: BLE001 - remembered for the failure message
            last_error = e
        time.sleep(interval)
    pytest.fail(
        f"timed out after {timeout}s waiting for {what}"
        + (f" (last error: {last_error})" if last_error else "")
    )


def settled(read: Callable[[], T], what: str, timeout: float = 30, interval: float = 0.2) -> T:
    """`read()` once two reads `interval` apart agree: a baseline that work still landing in the background
    (KV events on their way to a router, blocks on their way to a disk tier) would otherwise move."""
    deadline = time.monotonic() + timeout
    last = read()
    while True:
        time.sleep(interval)
        now = read()
        if now == last:
            return now
        if time.monotonic() > deadline:
            pytest.fail(f"{what} still changing after {timeout}s: {last} then {now}")
        last = now


@pytest.fixture(scope="session", autouse=True)
def _no_process_outlives_the_session() -> Iterator[None]:
    """The first fixture set up, the last torn down: any group a test or fixture left running stops."""
    yield
    stop_all()
