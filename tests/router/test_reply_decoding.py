"""A non-streamed reply from a pod that compressed it although the router asked for `identity`
(router/proxy.py `_decoded`): gzip and deflate, zlib-wrapped or raw, inflated as aiohttp's client did; what
it inflates to counted against the bound; a truncated or unknown coding a 502, never a 200 with the wrong
body. (Through a real router: tests/router/test_hostile_pods.py, a gzip reply inflated and a bomb refused.)"""

from __future__ import annotations

import gzip
import zlib

import pytest

from kvpilot.fanout.http1 import Reply
from kvpilot.protocol.errors import ApiError
from kvpilot.router.proxy import _decoded

BODY = b'{"object": "text_completion", "choices": [{"text": "' + b"ok " * 200 + b'"}]}'


def reply(body: bytes, coding: str | None, complete: bool = True) -> Reply:
    return Reply(200, body, {"content-encoding": coding} if coding else {}, complete)


def raw_deflate(data: bytes) -> bytes:
    c = zlib.compressobj(wbits=-zlib.MAX_WBITS)
    return c.compress(data) + c.flush()


def test_each_coding_is_inflated_and_identity_passes_as_it_came() -> None:
    assert _decoded(reply(BODY, None), 10_000) == BODY
    assert _decoded(reply(BODY, "identity"), 10_000) == BODY
    assert _decoded(reply(gzip.compress(BODY), "gzip"), 10_000) == BODY
    assert _decoded(reply(gzip.compress(BODY), "x-gzip"), 10_000) == BODY
    assert _decoded(reply(zlib.compress(BODY), "deflate"), 10_000) == BODY
    assert _decoded(reply(raw_deflate(BODY), "Deflate "), 10_000) == BODY


def test_a_body_past_the_bound_is_none_however_it_came() -> None:
    assert _decoded(reply(BODY[:100], None, complete=False), 100) is None
    bomb = gzip.compress(b"0" * 10_000_000)  # ~10 KB that inflate to 10 MB
    assert len(bomb) < 20_000 and _decoded(reply(bomb, "gzip"), 1_000_000) is None


@pytest.mark.parametrize(
    "body,coding",
    [(gzip.compress(BODY, mtime=0)[:-20], "gzip"), (b"not compressed", "deflate"), (BODY, "br")],
    ids=["truncated-gzip", "not-deflate", "br"],  # stable across xdist's workers (gzip stamps the time)
)
def test_a_truncated_broken_or_unknown_coding_is_a_502(body: bytes, coding: str) -> None:
    with pytest.raises(ApiError) as err:
        _decoded(reply(body, coding), 10_000)
    assert err.value.status == 502 and err.value.code == "bad_gateway"
