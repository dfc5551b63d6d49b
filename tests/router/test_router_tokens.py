"""The router's admin token stays in its fleet: a pod's reply body never reaches the router's reset reply
(only its status and a short, redacted error message)."""

from __future__ import annotations

import sys

from support import ROOT
from support.procs import free_port, spawn, wait_for
from support.servers import ADMIN_TOKEN, start_router, stop_router

STANDIN = ROOT / "tests" / "operator" / "standin.py"


def test_a_pods_reply_body_never_reaches_the_routers_reset_reply(tmp_path) -> None:  # noqa: ANN001
    pods, router = [], None
    try:
        for reply in ("echo-headers", "big"):
            port = free_port()
            argv = [sys.executable, str(STANDIN), "--host", "127.0.0.1", "--port", str(port)]
            proc = spawn(argv, log_path=tmp_path / f"{reply}.log", env={"STANDIN_REPLY": reply})
            pods.append((proc, f"http://127.0.0.1:{port}"))
        router = start_router(tmp_path, [url for _, url in pods], "--reset-timeout", "20", all_pods=False)
        wait_for(lambda: all(p["ready"] for p in router.health()["pods"]), 60, "both stand-ins ready")
        r = router.request("POST", "/reset_prefix_cache", headers=router.admin())
        assert r.status == 502, r.body[:500]
        assert len(r.body) < 4096, len(r.body)  # not the 2 MiB body
        assert ADMIN_TOKEN.encode() not in r.body, r.body
        by_status = {p["status"]: p for p in r.json()["pods"]}
        echo, big = by_status[400], by_status[500]
        assert "bad request" in echo["error"] and "Authorization: [redacted]" in echo["error"], echo
        assert big["error"].startswith("HTTP 500"), big
    finally:
        if router is not None:
            stop_router(router)
        for proc, _ in pods:
            proc.terminate()
