"""Finding a relayed stream's usage event in its tail (router/proxy.py `_sse_usage`): the last `data: {`
line that names "usage", whatever comes after it, and nothing when no such line is whole."""

from __future__ import annotations

from kvpilot.router.proxy import _sse_usage

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
