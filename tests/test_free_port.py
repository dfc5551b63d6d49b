"""devcluster.procs.free_port, which every test and bench server gets its port from."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from devcluster import procs


def test_ports_come_from_below_the_ephemeral_and_nodeport_ranges_and_never_twice() -> None:
    low, high = (int(x) for x in open("/proc/sys/net/ipv4/ip_local_port_range").read().split())
    if low < procs.PORT_RANGE.stop:
        pytest.skip(f"this machine's ephemeral ports ({low}-{high}) reach into free_port's range")
    ports = [procs.free_port() for _ in range(200)]
    assert len(set(ports)) == len(ports)
    assert all(p in procs.PORT_RANGE and not low <= p <= high and p < 30000 for p in ports)


def test_a_port_in_use_is_not_handed_out(monkeypatch, tmp_path: Path) -> None:
    monkeypatch.setattr(procs, "LEASES", tmp_path)  # no other process's lease on the ports drawn below
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        taken = held.getsockname()[1]
        # the draw forced onto the taken port first, then a port handed out before, then a free one
        monkeypatch.setattr(procs, "_handed", {29998})
        draws = iter([taken, 29998, 29999])
        monkeypatch.setattr(procs._ports, "choice", lambda _range: next(draws))
        assert procs.free_port() == 29999


def test_a_port_another_process_was_handed_is_not_handed_out_until_its_lease_ends(
    monkeypatch, tmp_path: Path
) -> None:
    # Another process draws a port and has not bound it yet: its bind check alone would pass here.
    monkeypatch.setattr(procs, "LEASES", tmp_path)
    other = subprocess.run(
        [sys.executable, "-c", LEASE_ONE, str(tmp_path)],
        env={**os.environ, "PYTHONPATH": str(Path(procs.__file__).parents[1])},  # devcluster's folder
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    leased = int(other.stdout)
    draws = iter([leased, 29999])
    monkeypatch.setattr(procs._ports, "choice", lambda _range: next(draws))
    monkeypatch.setattr(procs, "_handed", set())
    assert procs.free_port() == 29999
    # A lease past LEASE_S is over: the port is handed out again.
    old = time.time() - procs.LEASE_S - 1
    os.utime(tmp_path / str(leased), (old, old))
    monkeypatch.setattr(procs._ports, "choice", lambda _range: leased)
    assert procs.free_port() == leased


LEASE_ONE = """
import sys
from pathlib import Path
from devcluster import procs
procs.LEASES = Path(sys.argv[1])
print(procs.free_port())
"""


def test_a_lease_folder_that_cannot_be_used_leaves_the_bind_check_alone_to_decide(
    monkeypatch, tmp_path: Path
) -> None:
    (tmp_path / "file").write_text("")
    monkeypatch.setattr(procs, "LEASES", tmp_path / "file" / "leases")  # mkdir fails: its parent is a file
    assert procs.free_port() in procs.PORT_RANGE
