"""Request fields as vLLM treats them, through the real server on loopback: fields that ask for nothing
pass, SGLang's extensions map onto kvpilot's features, unknown fields are ignored (logged once per name,
named in X-Kvpilot-Ignored-Fields), and fields asking for what the server lacks are 400s (test_errors)."""

from __future__ import annotations

import json
import re
import socket
import time
import uuid

import pytest
from transformers import AutoTokenizer

from kvpilot.router.routing.prompts import tokenizer_dir
from support.servers import MODEL, Server

pytestmark = pytest.mark.timeout(300)

C, CH = "/v1/completions", "/v1/chat/completions"
HEADER = "X-Kvpilot-Ignored-Fields"
# What sglang-router 0.3.2 re-sends for `{"model", "messages", "max_tokens": 3}` and for a streamed
# completion (recorded from the real router in front of a capturing server).
SGLANG_CHAT = {
    "messages": [{"role": "user", "content": "hi"}],
    "model": MODEL,
    "logprobs": False,
    "max_completion_tokens": 3,
    "stream": False,
    "no_stop_trim": False,
    "ignore_eos": False,
    "continue_final_message": False,
    "skip_special_tokens": True,
    "separate_reasoning": True,
    "stream_reasoning": True,
    "return_hidden_states": False,
}
SGLANG_COMPLETION = {
    "model": MODEL,
    "prompt": "hi",
    "max_tokens": 3,
    "stream": True,
    "echo": False,
    "no_stop_trim": False,
    "ignore_eos": False,
    "skip_special_tokens": True,
    "return_hidden_states": False,
}


def unique(prefix: str) -> str:
    """A field name no earlier request used: the server logs each name once per process."""
    return f"{prefix}_{uuid.uuid4().hex[:8]}"


def test_sglang_router_defaults_are_served(server: Server) -> None:
    r = server.request("POST", CH, SGLANG_CHAT)
    assert r.status == 200, r.body
    assert r.json()["usage"]["completion_tokens"] <= 3
    assert HEADER not in r.headers
    r = server.request("POST", C, SGLANG_COMPLETION)
    assert r.status == 200, r.body
    assert r.body.rstrip().endswith(b"data: [DONE]")
    assert HEADER not in r.headers


def test_fields_that_ask_for_nothing_pass_unnamed(server: Server) -> None:
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}
    for extra in (
        {"logit_bias": {}, "return_hidden_states": False, "guided_json": None, "use_beam_search": False},
        {"tools": [tool], "tool_choice": "auto"},
        {"tools": [tool], "tool_choice": "none"},
        {"tools": [], "user": "u1", "metadata": {"a": "b"}, "store": True, "parallel_tool_calls": True},
        {"kv_transfer_params": {"do_remote_decode": False, "do_remote_prefill": False, "remote_host": None}},
    ):
        r = server.request("POST", CH, {**SGLANG_CHAT, **extra})
        assert r.status == 200, (extra, r.body)
        assert HEADER not in r.headers, extra


def test_unknown_fields_are_ignored_named_and_logged_once(server: Server) -> None:
    a, b = unique("some_unknown_field"), unique("vendor-option")
    for _ in range(3):
        r = server.request("POST", C, {"model": MODEL, "prompt": "hi", "max_tokens": 1, a: 1, b: {"x": [1]}})
        assert r.status == 200, r.body
        assert r.headers[HEADER] == f"{a},{b}"
    log = server.log()
    assert log.count(f"ignoring request field '{a}'") == 1, log[-3000:]
    assert log.count(f"ignoring request field '{b}'") == 1


def test_ignored_names_are_bounded_in_header_and_log(server: Server) -> None:
    tag = uuid.uuid4().hex[:8]
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 1}
    body |= {f"{tag}{i}<é \r\n>" + "x" * 300: i for i in range(200)}
    r = server.request("POST", C, json.dumps(body).encode())
    assert r.status == 200, r.body
    names = r.headers[HEADER].split(",")
    assert len(r.headers[HEADER]) <= 512 and 1 <= len(names) <= 16, r.headers[HEADER]
    assert all(re.fullmatch(r"[A-Za-z0-9_.?\-]{1,67}", n) for n in names), names
    assert names[0] == f"{tag}0??????" + "x" * (64 - len(tag) - 7) + "..."
    lines = [line for line in server.log().splitlines() if tag in line]
    assert 1 <= len(lines) <= 16 and all(len(line) < 300 for line in lines), lines


def test_openai_client_extra_body(client) -> None:  # noqa: ANN001
    name = unique("client_extension")
    extra = {name: True, "separate_reasoning": True, "stream_reasoning": True, "no_stop_trim": False}
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_completion_tokens=2, extra_body=extra
    )
    assert raw.headers[HEADER] == name
    assert raw.parse().usage.completion_tokens <= 2
    with client.completions.with_streaming_response.create(
        model=MODEL, prompt="hi", max_tokens=2, stream=True, extra_body=extra
    ) as stream:
        # The reasoning switches are chat fields: a completion ignores and names them.
        assert stream.headers[HEADER] == f"{name},separate_reasoning,stream_reasoning"
        assert any(line.startswith("data: [DONE]") for line in stream.iter_lines())


def test_no_stop_trim_keeps_the_stop_string(server: Server) -> None:
    base = {"model": MODEL, "prompt": "The days of the week are Monday,", "max_tokens": 12, "temperature": 0}
    text = server.request("POST", C, base).json()["choices"][0]["text"]
    stop = text[len(text) // 2 :][:3]
    assert stop.strip(), text
    cut = server.request("POST", C, {**base, "stop": [stop]}).json()["choices"][0]["text"]
    kept = server.request("POST", C, {**base, "stop": [stop], "no_stop_trim": True}).json()["choices"][0][
        "text"
    ]
    assert not cut.endswith(stop) and kept == cut + stop, (text, stop, cut, kept)
    vllm = {**base, "stop": [stop], "include_stop_str_in_output": True}
    assert server.request("POST", C, vllm).json()["choices"][0]["text"] == kept


def test_continue_final_message_continues_the_assistant_turn(server: Server) -> None:
    messages = [
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": "My favourite is"},
    ]
    tok = AutoTokenizer.from_pretrained(tokenizer_dir(None))
    expected = tok.apply_chat_template(messages, tokenize=False, continue_final_message=True)
    assert expected.endswith("My favourite is")
    body = {"model": MODEL, "messages": messages, "max_tokens": 1, "temperature": 0}
    r = server.request("POST", CH, {**body, "continue_final_message": True})
    assert r.status == 200, r.body
    assert r.json()["usage"]["prompt_tokens"] == len(tok(expected, add_special_tokens=False)["input_ids"])
    closed = server.request("POST", CH, body).json()["usage"]["prompt_tokens"]
    assert closed > r.json()["usage"]["prompt_tokens"]  # the turn closed, a new one opened


def test_an_http2_probe_is_refused_in_one_log_line(server: Server) -> None:
    """SGLang's router opens each worker with HTTP/2 prior knowledge, then falls back to HTTP/1.1."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as s:
        s.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")
        assert s.recv(200).split(b"\r\n")[0].endswith(b" 400 Bad Request")
    deadline = time.monotonic() + 10
    while "refused with 400" not in server.log():
        assert time.monotonic() < deadline, server.log()[-2000:]
        time.sleep(0.05)
    assert "Traceback" not in server.log()
