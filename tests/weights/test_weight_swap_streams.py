"""A swap under concurrent requests, in each pause mode: no response mixes versions. Each response's
`system_fingerprint` is one version throughout (every stream chunk), and its text is that version's
greedy output (whole when it finished, a prefix when it was aborted)."""

from __future__ import annotations

import http.client
import json
import threading
import time
from pathlib import Path

import pytest

from support.servers import Server
from support.weights import greedy, tokenizer, update

PROMPTS = ["The river", "Once upon a time", "My favourite food is", "Dear friend,"]
STREAM_TOKENS = 10
PLAIN_TOKENS = 24  # the non-streamed ones run long enough to be in flight at the swap


class Reply:
    def __init__(self, prompt: list[int], stream: bool) -> None:
        self.prompt, self.stream = prompt, stream
        self.fingerprints: list[str] = []
        self.text = ""
        self.finish: str | None = None
        self.error: str | None = None


def _run(srv: Server, reply: Reply) -> None:
    tokens = STREAM_TOKENS if reply.stream else PLAIN_TOKENS
    body = {"prompt": reply.prompt, "max_tokens": tokens, "temperature": 0, "stream": reply.stream}
    conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=300)
    try:
        conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            reply.error = f"{resp.status} {resp.read()!r}"
            return
        if not reply.stream:
            data = json.loads(resp.read())
            reply.fingerprints.append(data["system_fingerprint"])
            reply.text = data["choices"][0]["text"]
            reply.finish = data["choices"][0]["finish_reason"]
            return
        for line in resp:
            line = line.strip()
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            reply.fingerprints.append(chunk["system_fingerprint"])
            choice = chunk["choices"][0]
            reply.text += choice["text"]
            reply.finish = choice["finish_reason"] or reply.finish
    except Exception as exc:  # noqa: BLE001 - reported by the assertion below
        reply.error = repr(exc)
    finally:
        conn.close()


@pytest.mark.parametrize("mode", ["abort", "wait", "keep"])
def test_no_response_mixes_versions(
    quiet: Server, mode: str, original_checkpoint: Path, changed_checkpoint: Path
) -> None:
    srv = quiet
    tok = tokenizer(original_checkpoint)
    old, new = f"{mode}-old", f"{mode}-new"
    update(srv, original_checkpoint, old)
    weights = {old: original_checkpoint, new: changed_checkpoint}

    replies = [Reply(tok(p)["input_ids"], stream=i < 2) for i, p in enumerate(PROMPTS)]
    threads = [threading.Thread(target=_run, args=(srv, r)) for r in replies]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 120
    while not all(r.text or r.finish or r.error for r in replies if r.stream):
        assert time.monotonic() < deadline, "the streams never started"
        time.sleep(0.02)
    update(srv, changed_checkpoint, new, mode)
    for t in threads:
        t.join(300)

    for r in replies:
        assert r.error is None, r.error
        versions = set(r.fingerprints)
        assert len(versions) == 1, (mode, r.fingerprints)  # one version for the whole response
        version = versions.pop()
        tokens = STREAM_TOKENS if r.stream else PLAIN_TOKENS
        want = tok.decode(list(greedy(weights[version], tuple(r.prompt), tokens)))
        if r.finish == "abort":
            assert want.startswith(r.text), (mode, version, r.text, want)
        else:
            assert r.text == want, (mode, version, r.text, want)
    streams = [r for r in replies if r.stream]
    if mode == "wait":  # drained: everything in flight finished on the old weights
        assert all(r.finish == "length" and r.fingerprints[0] == old for r in replies)
    if mode == "abort":
        assert all(r.finish == "abort" and r.fingerprints[0] == old for r in streams)
    if mode == "keep":  # streams that had sent tokens end; the others are recomputed on the new weights
        assert all(r.finish == "abort" for r in streams)
        assert any(r.fingerprints[0] == new and r.finish == "length" for r in replies if not r.stream)
