"""devcluster.procs.free_port, which every test and bench server gets its port from."""

from __future__ import annotations

import socket

import pytest

from devcluster import procs


def test_ports_come_from_below_the_ephemeral_and_nodeport_ranges_and_never_twice() -> None:
    low, high = (int(x) for x in open("/proc/sys/net/ipv4/ip_local_port_range").read().split())
    if low < procs.PORT_RANGE.stop:
        pytest.skip(f"this machine's ephemeral ports ({low}-{high}) reach into free_port's range")
    ports = [procs.free_port() for _ in range(200)]
    assert len(set(ports)) == len(ports)
    assert all(p in procs.PORT_RANGE and not low <= p <= high and p < 30000 for p in ports)


def test_a_port_in_use_is_not_handed_out(monkeypatch) -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        taken = held.getsockname()[1]
        # the draw forced onto the taken port first, then a port handed out before, then a free one
        monkeypatch.setattr(procs, "_handed", {29998})
        draws = iter([taken, 29998, 29999])
        monkeypatch.setattr(procs._ports, "choice", lambda _range: next(draws))
        assert procs.free_port() == 29999
