"""Two real daemons publishing KV events, and `kvpilot router` processes in front of them, on loopback."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from server.conftest import ADMIN_TOKEN, Server, free_port, start_server, stop_server


def start_daemon(tmp: Path, token: str | None = ADMIN_TOKEN, host: str = "127.0.0.1") -> Server:
    return start_server(tmp, "--host", host, "--kv-events-endpoint", f"tcp://{host}:{free_port()}",
                        "--kv-events-replay-endpoint", f"tcp://{host}:{free_port()}", token=token)  # fmt: skip


class RouterProc(Server):
    """A `kvpilot router` process: the daemon test helpers (request, admin, metrics, log) apply as is."""

    def health(self) -> dict:
        return self.request("GET", "/health").json()

    def pod(self, name: str) -> dict:
        return next(p for p in self.health()["pods"] if p["pod"] == name)


def start_router(tmp: Path, endpoints: list[str] | None, *extra: str, token: str | None = ADMIN_TOKEN,
                 all_pods: bool = True, env: dict | None = None) -> RouterProc:  # fmt: skip
    """Start a router; return once every pod is ready and its KV events synced (or, with `all_pods`
    false, once the router serves at all)."""
    port = free_port()
    log_path = tmp / f"router-{port}.log"
    args = [sys.executable, "-m", "kvpilot", "router", "--host", "127.0.0.1", "--port", str(port), *extra]
    if endpoints is not None:
        args += ["--endpoints", ",".join(endpoints)]
    if token is not None:
        token_file = tmp / f"router-token-{port}"
        token_file.write_text(token + "\n")
        args += ["--admin-token-file", str(token_file)]
    proc_env = {k: v for k, v in os.environ.items() if k != "KVPILOT_ADMIN_TOKEN"} | (env or {})
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=proc_env)
    router = RouterProc(proc, port, log_path, token)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"kvpilot router exited with {proc.returncode}:\n{router.log()}")
        try:
            h = router.health()
            pods = h["pods"]
            if (pods and all(p["ready"] and p["synced"] for p in pods)) or (
                not all_pods and h["status"] == "ok"
            ):
                return router
        except (OSError, ValueError):
            pass
        time.sleep(0.3)
    proc.kill()
    raise RuntimeError(f"kvpilot router did not become ready:\n{router.log()}")


def stop_router(router: RouterProc) -> None:
    stop_server(router)
    assert "Traceback" not in router.log(), router.log()[-4000:]


def stop_fleet(router: RouterProc | None, daemons: list[Server]) -> None:
    """Stop the router (which raises on a traceback in its log) and, whatever it raised, the daemons."""
    try:
        if router is not None:
            stop_router(router)
    finally:
        for d in daemons:
            stop_server(d)


@dataclass
class Fleet:
    daemons: list[Server]
    router: RouterProc

    def by_name(self, name: str) -> Server:
        return next(d for d in self.daemons if f"127.0.0.1:{d.port}" == name)


@pytest.fixture(scope="session")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Fleet:
    tmp = tmp_path_factory.mktemp("fleet")
    daemons = [start_daemon(tmp), start_daemon(tmp)]
    router = None
    try:
        router = start_router(tmp, [d.url for d in daemons])
        yield Fleet(daemons, router)
    finally:
        stop_fleet(router, daemons)
    for d in daemons:
        assert "Traceback" not in d.log(), d.log()[-4000:]


@pytest.fixture
def quiet_fleet(fleet: Fleet) -> Fleet:
    """The shared fleet with no request left running on any pod by an earlier test."""
    deadline = time.monotonic() + 60
    for d in fleet.daemons:
        while (c := d.cache())["num_running"] or c["num_waiting"]:
            assert time.monotonic() < deadline, c
            time.sleep(0.2)
    return fleet
