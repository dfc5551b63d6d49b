"""A client that hangs up mid-stream frees its blocks within one engine step; admin token cases."""

from __future__ import annotations

import json
import socket
import time

import pytest

from kvpilot.serving.admin_token import AdminTokenError, authorized, load_admin_token
from support.servers import ADMIN_TOKEN, Server, read_until_decoding, send_completion

pytestmark = pytest.mark.timeout(300)


def open_stream(server: Server, max_tokens: int) -> socket.socket:
    sock = send_completion(server.port, max_tokens, stream=True)
    received = read_until_decoding(sock)
    assert b"200 OK" in received.split(b"\r\n", 1)[0]
    return sock


def test_disconnect_mid_stream_frees_blocks_within_one_step(quiet: Server) -> None:
    server = quiet
    sock = open_stream(server, max_tokens=400)  # would run ~400 more steps if not aborted
    busy = server.cache()
    assert busy["num_running"] == 1 and busy["blocks_used"] > 0
    steps_before = busy["engine_steps"]
    sock.close()
    deadline = time.monotonic() + 30
    while (stats := server.cache())["blocks_used"] or stats["num_running"]:
        assert time.monotonic() < deadline, stats
        time.sleep(0.02)
    # The step running when the client left may finish; the abort is applied before the next one.
    assert stats["engine_steps"] - steps_before <= 2, (steps_before, stats)
    assert server.request("GET", "/health").status == 200


def test_disconnect_while_waiting_for_a_non_streamed_reply_aborts_too(quiet: Server) -> None:
    server = quiet
    sock = send_completion(server.port, 400, stream=False)
    deadline = time.monotonic() + 30
    while (busy := server.cache())["num_running"] == 0:
        assert time.monotonic() < deadline, busy
        time.sleep(0.05)
    steps_before = busy["engine_steps"]
    sock.close()
    while (stats := server.cache())["blocks_used"] or stats["num_running"]:
        assert time.monotonic() < deadline, stats
        time.sleep(0.02)
    assert stats["engine_steps"] - steps_before <= 2, (steps_before, stats)


@pytest.mark.parametrize(
    ("header", "status"),
    [
        (None, 401),
        ("Bearer wrong-token", 401),
        (f"Bearer {ADMIN_TOKEN}x", 401),
        (f"Basic {ADMIN_TOKEN}", 401),
        (ADMIN_TOKEN, 401),
        (f"Bearer {ADMIN_TOKEN}", 200),
        (f"bearer {ADMIN_TOKEN}", 200),
    ],
)
def test_admin_token_on_reset(server: Server, header: str | None, status: int) -> None:
    before = server.cache()["epoch"]
    r = server.request("POST", "/reset_prefix_cache", headers={"Authorization": header} if header else {})
    assert r.status == status, r.body
    assert ADMIN_TOKEN not in r.body.decode()
    if status == 401:
        err = r.json()["error"]
        assert err["type"] == "authentication_error" and err["message"]
        assert server.cache()["epoch"] == before  # refused means nothing happened
    else:
        assert r.json()["success"] is True and server.cache()["epoch"] == before + 1


def test_public_routes_need_no_token(server: Server) -> None:
    for path in ("/health", "/metrics", "/prefix_cache", "/v1/models"):
        assert server.request("GET", path).status == 200, path


def test_admin_token_sources(tmp_path) -> None:  # noqa: ANN001
    f = tmp_path / "token"
    f.write_text("  from-file\n")
    assert load_admin_token(f, {"KVPILOT_ADMIN_TOKEN": "from-env"}) == "from-file"
    assert load_admin_token(None, {"KVPILOT_ADMIN_TOKEN": "from-env"}) == "from-env"
    assert load_admin_token(None, {}) is None
    f.write_text("\n")
    with pytest.raises(AdminTokenError):
        load_admin_token(f, {})
    with pytest.raises(AdminTokenError):
        load_admin_token(tmp_path / "missing", {})
    with pytest.raises(AdminTokenError):
        load_admin_token(None, {"KVPILOT_ADMIN_TOKEN": " "})
    assert authorized(None, None) and authorized("anything", None)
    assert not authorized(None, "t") and not authorized("Bearer", "t") and authorized("Bearer t", "t")


@pytest.mark.parametrize("raw", [b"Bearer \xff\xfe\xfd", b"Bearer " + ADMIN_TOKEN.encode() + b"\xc3"])
def test_admin_token_that_is_not_utf8_is_401(server: Server, raw: bytes) -> None:
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=30)
    sock.sendall(
        b"POST /reset_prefix_cache HTTP/1.1\r\nHost: x\r\nAuthorization: "
        + raw
        + b"\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
    )
    reply = b""
    while chunk := sock.recv(65536):
        reply += chunk
    sock.close()
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.split(b" ")[1] == b"401", reply[:300]
    assert json.loads(body)["error"]["type"] == "authentication_error"
