"""What a newcomer sees in the shell: JSON replies end with a newline (so `curl -s` output does not run into
the prompt), server-sent events keep their framing, and the startup log says when and where to type next."""

from __future__ import annotations

import re

from support.servers import MODEL, Server


def test_json_replies_end_with_a_newline(quiet: Server) -> None:
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "Hi!"}], "max_tokens": 2}
    replies = {
        "health": quiet.request("GET", "/health"),
        "models": quiet.request("GET", "/v1/models"),
        "prefix_cache": quiet.request("GET", "/prefix_cache"),
        "chat": quiet.request("POST", "/v1/chat/completions", chat),
        "reset": quiet.request("POST", "/reset_prefix_cache", headers=quiet.admin()),
        "unauthorized reset": quiet.request("POST", "/reset_prefix_cache"),
        "not found": quiet.request("GET", "/no/such/path"),
        "bad body": quiet.request("POST", "/v1/completions", b"{"),
    }
    for name, r in replies.items():
        assert r.headers["Content-Type"].startswith("application/json"), (name, r.headers)
        assert r.body.endswith(b"}\n") and r.body.count(b"\n") == 1, (name, r.body[-200:])
        r.json()  # still one JSON document


def test_server_sent_events_keep_their_framing(quiet: Server) -> None:
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 2, "stream": True}
    r = quiet.request("POST", "/v1/completions", body)
    assert r.status == 200 and r.body.endswith(b"data: [DONE]\n\n"), r.body[-200:]
    assert all(event.startswith(b"data: ") for event in r.body.split(b"\n\n") if event), r.body


def test_the_startup_log_says_where_to_type_next(server: Server) -> None:
    ready = [line for line in server.log().splitlines() if "ready: in another shell" in line]
    assert len(ready) == 1, server.log()[-3000:]
    url = f"http://127.0.0.1:{server.port}"  # the address it listens on (a wildcard one reads as localhost)
    assert f"`curl -s {url}/v1/models`" in ready[0] and f"`.venv/bin/kvpilot bench --url {url}`" in ready[0]
    # and it comes after the model is loaded and the port is listening: the last startup line
    lines = server.log().splitlines()
    assert re.search(r"serving .* on http://127\.0\.0\.1:\d+", lines[lines.index(ready[0]) - 1]), lines[-5:]
