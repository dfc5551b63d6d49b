"""Finding a reply's usage (router/proxy.py): a relayed stream's in its tail (`_sse_usage`), the last
`data: {` line that names "usage", whatever comes after it, and nothing when no such line is whole; a whole
reply's (`_json_usage`), the value of its top-level "usage" key, never text that spells one nor a "usage"
nested in its choices or in an echoed request, found in time linear in the reply's size."""

from __future__ import annotations

import json

import pytest

from kvpilot.router import proxy
from kvpilot.router.proxy import _json_usage, _sse_usage

USAGE = (
    b'data: {"id":"c","choices":[],"usage":{"prompt_tokens":9,"prompt_tokens_details":{"cached_tokens":0}}}'
)


def test_the_last_usage_line_is_read() -> None:
    chunk = b'data: {"id":"c","choices":[{"delta":{"content":"usage"}}],"usage":null}'
    tail = b"\n\n".join([chunk, chunk, USAGE, b"data: [DONE]"]) + b"\n\n"
    assert _sse_usage(tail) == {"prompt_tokens": 9, "prompt_tokens_details": {"cached_tokens": 0}}
    # CRLF line ends, and a tail cut right after the line
    assert _sse_usage(tail.replace(b"\n", b"\r\n"))["prompt_tokens"] == 9
    assert _sse_usage(USAGE)["prompt_tokens"] == 9
    # a later line naming "usage" that is not a data line does not hide it
    assert _sse_usage(USAGE + b'\n\n: comment "usage"\n\n')["prompt_tokens"] == 9


def test_no_usage_or_a_broken_one_is_none() -> None:
    assert _sse_usage(b"") is None
    assert _sse_usage(b'data: {"choices":[],"usage":null}\n\ndata: [DONE]\n\n') is None
    assert _sse_usage(USAGE[:-10] + b"\n\n") is None  # cut off: not JSON
    assert _sse_usage(b'data: ["usage"]\n\n') is None  # not an object line
    assert _sse_usage(USAGE[20:] + b"\n\n") is None  # its start lost before the tail's


def test_a_replys_usage_is_its_last_usage_key() -> None:
    usage = {"prompt_tokens": 9, "prompt_tokens_details": {"cached_tokens": 8}}
    reply = {
        "choices": [
            {
                "text": 'say "usage": {"prompt_tokens": 1} \\"usage\\"',
                "logprobs": {"top_logprobs": [{"usage": -0.5}]},  # a token "usage" as a key, before
            }
        ],
        "usage": usage,
        "prompt_logprobs": [None, {"7": {"decoded_token": "usage"}}],  # vLLM writes these after usage
    }
    body = json.dumps(reply).encode()
    assert _json_usage(body) == usage
    assert _json_usage(json.dumps(reply, indent=2).encode()) == usage
    assert _json_usage(json.dumps({"usage": None, "x": 1}).encode()) is None
    assert _json_usage(b'{"choices": [{"text": "usage"}]}') is None
    assert _json_usage(body[:-60]) is None  # cut off: no whole object, so no key of it is known top-level
    assert _json_usage(b'{"usage": {"prompt_tokens": ') is None  # cut off
    # a key that ends in "usage (its quote escaped) is not the usage, nor is a later "usage" that is no object
    assert _json_usage(b'{"usage": {"a": 1}, "\\"usage": {"b": 2}}') == {"a": 1}
    assert _json_usage(b'{"usage": {"a": 1}, "x": [{"usage": -0.5}]}') == {"a": 1}
    assert _json_usage(b'{"usage": ' + b"[" * 100_000 + b"]" * 100_000 + b"}") is None  # nested too deep


def test_a_usage_nested_in_a_reply_is_not_its_usage() -> None:
    """Only the reply's own usage counts: not one inside its choices, nor one in a request an error reply
    echoes (FastAPI's 422 puts the body it refused under "input"), which a client could fill in."""
    fake = {"prompt_tokens_details": {"cached_tokens": 10**9}}
    echoed = {"detail": [{"loc": ["body"], "input": {"messages": [], "temperature": "x", "usage": fake}}]}
    assert _json_usage(json.dumps(echoed).encode()) is None
    nested = {"choices": [{"text": "x", "meta": {"usage": fake}}], "usage": None}
    assert _json_usage(json.dumps(nested).encode()) is None
    usage = {"prompt_tokens": 3, "usage": {}}  # a "usage" inside the usage itself
    assert _json_usage(json.dumps({"id": "c", "usage": usage}).encode()) == usage


def test_a_reply_full_of_usage_keys_is_read_a_bounded_number_of_times(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each "usage" key found from the end has its value parsed: a reply of many (a pod's choices may hold
    them) is given up after MAX_USAGE_KEYS, where reading each once made the cost grow with their square
    (a 384 KB reply held the event loop for half a second)."""
    parsed = []

    class Counting(json.JSONDecoder):
        def raw_decode(self, s: str, idx: int = 0) -> tuple[object, int]:
            parsed.append(idx)
            return super().raw_decode(s, idx)

    monkeypatch.setattr(proxy, "_JSON", Counting())
    many = b'{"choices":[' + b",".join([b'{"usage":0}'] * 50_000) + b"]}"
    assert _json_usage(many) is None
    assert 0 < len(parsed) <= proxy.MAX_USAGE_KEYS
