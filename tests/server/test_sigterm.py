"""SIGTERM: stop accepting, let in-flight streams finish, exit 0.

Runs its own server, also a second configuration: no admin token, prefix caching off.
"""

from __future__ import annotations

import signal
import socket
import time

import pytest

from support.servers import start_server, stop_server

from .test_disconnect_and_admin import open_stream

pytestmark = pytest.mark.timeout(400)


def read_to_end(sock: socket.socket) -> bytes:
    data = b""
    sock.settimeout(120)
    while not data.endswith(b"0\r\n\r\n"):  # the last chunk of a chunked response
        chunk = sock.recv(65536)
        if not chunk:
            break
        data += chunk
    return data


def test_sigterm_drains_in_flight_streams_and_exits_0(tmp_path) -> None:  # noqa: ANN001
    server = start_server(tmp_path, "--shutdown-timeout", "120", "--no-enable-prefix-caching")
    try:
        # Without a configured token the admin route is open.
        assert server.request("POST", "/reset_prefix_cache").status == 200
        # With prefix caching off, usage carries no cached_tokens and the stats say so.
        r = server.request("POST", "/v1/completions", {"prompt": "hi", "max_tokens": 1})
        assert r.status == 200 and "prompt_tokens_details" not in r.json()["usage"]
        assert server.cache()["enable_prefix_caching"] is False
        socks = [open_stream(server, max_tokens=12) for _ in range(3)]
        server.proc.send_signal(signal.SIGTERM)

        deadline = time.monotonic() + 30
        while True:  # the listening socket closes at once
            try:
                socket.create_connection(("127.0.0.1", server.port), timeout=2).close()
            except ConnectionRefusedError:
                break
            assert time.monotonic() < deadline, "still accepting connections after SIGTERM"
            time.sleep(0.1)

        for sock in socks:
            tail = read_to_end(sock)
            sock.close()
            assert b"data: [DONE]" in tail, tail[-500:]
            assert b'"finish_reason":"length"' in tail  # ran to its full 12 tokens, not cut off
        assert server.proc.wait(120) == 0
        log = server.log()
        assert "draining" in log and "Traceback" not in log
    finally:
        stop_server(server)
