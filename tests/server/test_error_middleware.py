"""The error middleware the daemon and the router share, and the server start both use
(kvpilot/serving/http_limits.py), on a small application of its own over real loopback HTTP: whatever a handler
raises, the client gets OpenAI's error JSON, never aiohttp's plain-text 500."""

from __future__ import annotations

import asyncio
import logging

import aiohttp
import pytest
from aiohttp import web

from kvpilot.protocol.errors import ApiError, error_middleware
from kvpilot.serving.http_limits import ConnectionLimits, start_server

pytestmark = pytest.mark.timeout(120)


async def _raises(request: web.Request) -> web.Response:
    kind = request.match_info["kind"]
    if kind == "bug":
        raise KeyError("a bug in a handler")
    if kind == "recursion":
        raise RecursionError("maximum recursion depth exceeded")
    if kind == "api":
        raise ApiError(503, "busy", code="busy", headers={"Retry-After": "1"})
    if kind == "body":
        await request.read()
    return web.Response(text="fine")


async def _ask(cases: list[tuple[str, str, bytes | None]]) -> list[tuple[int, dict, dict]]:
    app = web.Application(client_max_size=1024, middlewares=[error_middleware(1024)])
    app.router.add_post("/raise/{kind}", _raises)
    served = await start_server(app, "127.0.0.1", 0, ConnectionLimits())
    out = []
    try:
        async with aiohttp.ClientSession() as session:
            for method, path, body in cases:
                url = f"http://127.0.0.1:{served.port}{path}"
                async with session.request(method, url, data=body) as r:
                    assert r.content_type == "application/json", await r.text()
                    out.append((r.status, await r.json(), dict(r.headers)))
    finally:
        await served.cleanup()
    return out


def test_every_failure_is_openai_error_json(caplog: pytest.LogCaptureFixture) -> None:
    cases = [
        ("POST", "/raise/bug", None),
        ("POST", "/raise/recursion", None),
        ("POST", "/raise/api", None),
        ("POST", "/raise/body", b"x" * 2048),
        ("GET", "/raise/bug", None),
        ("GET", "/nowhere", None),
    ]
    with caplog.at_level(logging.ERROR, logger="kvpilot.protocol.errors"):
        replies = asyncio.run(_ask(cases))
    codes = [(status, body["error"]["code"]) for status, body, _ in replies]
    assert codes == [
        (500, "internal_error"),
        (400, "nested_too_deeply"),
        (503, "busy"),
        (413, "request_too_large"),
        (405, "method_not_allowed"),
        (404, "not_found"),
    ]
    for _, body, _ in replies:
        assert set(body["error"]) == {"message", "type", "param", "code"}
        assert "Traceback" not in body["error"]["message"] and "KeyError" not in body["error"]["message"]
    assert replies[2][2]["Retry-After"] == "1" and replies[4][2]["Allow"] == "POST"
    # The bug is in the server's log, with its stack, and nowhere else.
    assert any("a bug in a handler" in (r.exc_text or "") for r in caplog.records)


def test_limits_refuse_a_header_timeout_an_idle_pool_could_race() -> None:
    with pytest.raises(ValueError, match="header_timeout"):
        ConnectionLimits(header_timeout=2).validate()
    with pytest.raises(ValueError, match="max_connections"):
        ConnectionLimits(max_connections=0).validate()
