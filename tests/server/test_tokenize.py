"""vLLM's `POST /tokenize` on a real daemon: the ids are the ones generation runs (vllm-router's kv_aware
policy keys a request's blocks from them), in vLLM 0.32's reply shape, and bad input is a 400."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from kvpilot.default_model import ensure_default_model
from support.servers import MODEL, Server

pytestmark = pytest.mark.timeout(300)

PROMPT = "Tokenize me: the quick brown fox jumps over the lazy dog."
MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Name a colour."},
]


def tokenize(server: Server, body: dict | bytes) -> dict:
    r = server.request("POST", "/tokenize", body)
    assert r.status == 200, r.body
    return r.json()


def prompt_tokens(server: Server, path: str, body: dict) -> int:
    r = server.request("POST", path, {**body, "max_tokens": 1, "temperature": 0})
    assert r.status == 200, r.body
    return r.json()["usage"]["prompt_tokens"]


def test_completion_form_is_the_tokenizers_ids(server: Server) -> None:
    out = tokenize(server, {"model": MODEL, "prompt": PROMPT})
    ids = AutoTokenizer.from_pretrained(ensure_default_model())(PROMPT)["input_ids"]
    assert out == {"count": len(ids), "max_model_len": 512, "tokens": ids, "token_strs": None}, out
    assert out["count"] == prompt_tokens(server, "/v1/completions", {"prompt": PROMPT})
    # The ids as a prompt run the same prompt.
    assert prompt_tokens(server, "/v1/completions", {"prompt": out["tokens"]}) == out["count"]


def test_completion_form_options(server: Server) -> None:
    plain = tokenize(server, {"prompt": PROMPT})  # model is optional, as in vLLM
    strs = tokenize(server, {"prompt": PROMPT, "return_token_strs": True})
    assert strs["tokens"] == plain["tokens"] and len(strs["token_strs"]) == strs["count"], strs
    assert "".join(strs["token_strs"]).replace("Ġ", " ") == PROMPT, strs["token_strs"]
    bare = tokenize(server, {"prompt": PROMPT, "add_special_tokens": False})
    assert 0 < bare["count"] <= plain["count"], (bare, plain)


def test_chat_form_matches_chat_completions(server: Server) -> None:
    out = tokenize(server, {"model": MODEL, "messages": MESSAGES})
    assert out["count"] == len(out["tokens"]) > 10 and out["token_strs"] is None, out
    assert out["count"] == prompt_tokens(server, "/v1/chat/completions", {"messages": MESSAGES})
    # Without the generation prompt the assistant turn is not opened: fewer tokens, a prefix of them.
    closed = tokenize(server, {"messages": MESSAGES, "add_generation_prompt": False})
    assert closed["tokens"] == out["tokens"][: closed["count"]] and closed["count"] < out["count"]
    # Continuing a final assistant message: as generation would run it.
    cont = {"messages": [*MESSAGES, {"role": "assistant", "content": "Bl"}], "continue_final_message": True}
    assert tokenize(server, cont)["count"] == prompt_tokens(server, "/v1/chat/completions", cont)


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        (b"not json", 400, None),
        ({"model": "other-model", "prompt": "x"}, 404, "model"),
        ({"prompt": ["a", "b"]}, 400, "prompt"),
        ({"prompt": [1, 2, 3]}, 400, "prompt"),
        ({}, 400, "prompt"),
        ({"prompt": "x", "add_special_tokens": "yes"}, 400, "add_special_tokens"),
        ({"messages": []}, 400, "messages"),
        ({"messages": MESSAGES, "continue_final_message": True, "add_generation_prompt": True}, 400, None),
        ({"messages": MESSAGES, "chat_template_kwargs": {"enable_thinking": True}}, 400, None),
        ({"prompt": "word " * 200_000}, 400, "prompt"),
    ],
)
def test_bad_input(server: Server, body: dict | bytes, status: int, param: str | None) -> None:
    r = server.request("POST", "/tokenize", body)
    assert r.status == status, r.body
    err = r.json()["error"]
    assert err["message"], err
    if param is not None:
        assert err["param"] == param, err
