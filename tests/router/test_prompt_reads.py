"""kvpilot.protocol.requests.chat_prompt and completion_prompts, the router's read of a request: the same
prompts and salt as the daemon's parse_chat and parse_completion on every body both take, whatever else the
body holds; nothing they do not need is checked."""

from __future__ import annotations

import pytest

from kvpilot.protocol import requests
from kvpilot.protocol.errors import ApiError
from kvpilot.protocol.requests import chat_prompt, completion_prompts, parse_chat, parse_completion
from kvpilot.router.routing.prompts import PromptReader

MODEL = "SmolLM2-135M-Instruct"
BODIES = [
    {"messages": [{"role": "user", "content": "Hi"}]},
    {
        "model": MODEL,
        "messages": [
            {"role": "developer", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
            {"role": "assistant", "content": None},
        ],
        "cache_salt": "tenant-a",
        "temperature": 0,
        "max_tokens": 8,
    },
    {
        "messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "We open at"}],
        "continue_final_message": True,
        "add_generation_prompt": False,
        "separate_reasoning": True,
        "unknown_field": [1, 2],
    },
    {"messages": [{"role": "user", "content": "x", "name": "bob"}], "add_generation_prompt": False},
    {
        "messages": [{"role": "user", "content": "x"}],
        "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}],
        "tool_choice": "auto",
    },
]
# Plain messages and no other prompt field: read without the pydantic model (chat_prompt's fast path).
PLAIN_BODIES = [
    {
        "model": MODEL,
        "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": ""}],
    },
    {"messages": [{"role": "developer", "content": "a"}, {"role": "user", "content": "b", "name": "bob"}]},
    {
        "messages": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}],
        "stream": True,
    },
    {"messages": [{"role": "user", "content": "x"}, {"role": "tool", "content": "42"}], "max_tokens": 3},
]
BODIES += PLAIN_BODIES


@pytest.mark.parametrize("body", BODIES)
def test_the_prompt_and_salt_are_the_daemons(body: dict) -> None:
    chat = parse_chat(dict(body), [MODEL])
    assert chat_prompt(dict(body)) == (chat.prompt, chat.generate.cache_salt)


def test_plain_messages_are_read_without_the_model(monkeypatch: pytest.MonkeyPatch) -> None:
    """The fast path is taken for plain bodies (the equality above holds it right): the model is not asked."""

    def refuse(*args: object) -> None:
        raise AssertionError("the pydantic model read a plain chat")

    monkeypatch.setattr(requests, "_validate", refuse)
    for body in [BODIES[0], *PLAIN_BODIES]:
        assert chat_prompt(dict(body))[0].messages[-1]["content"] == body["messages"][-1]["content"]
    with pytest.raises(AssertionError):
        chat_prompt({"messages": [{"role": "user", "content": "x"}], "cache_salt": "s"})


def test_only_the_prompts_fields_are_checked() -> None:
    body = {"messages": [{"role": "user", "content": "x"}], "temperature": -1, "logit_bias": {"1": 2}}
    with pytest.raises(ApiError):
        parse_chat(dict(body), [MODEL])
    assert chat_prompt(body)[0].messages == [{"role": "user", "content": "x"}]


@pytest.mark.parametrize(
    "body",
    [
        {"messages": []},
        {"messages": [{"role": "robot", "content": "x"}]},
        {"messages": [{"role": "user", "content": {"image": 1}}]},
        {"messages": [{"role": "user", "content": "x"}], "cache_salt": ""},
        {"messages": [{"role": "user", "content": "x"}], "add_generation_prompt": "yes"},
        {"messages": [{"role": ["user"], "content": "x"}]},
        {"messages": [{"role": "user"}]},
        {"messages": [{"role": "user", "content": None}]},
        {"messages": [{"role": "user", "content": "x"}, "hello"]},
        {"messages": {"role": "user", "content": "x"}},
        {"messages": "hello"},
    ],
)
def test_a_prompt_the_daemon_refuses_is_refused(body: dict) -> None:
    for parse in (lambda b: parse_chat(b, [MODEL]), chat_prompt):
        with pytest.raises(ApiError):
            parse(dict(body))


COMPLETIONS = [
    {"prompt": "Once upon a time"},
    {"model": MODEL, "prompt": ["a", "b"], "cache_salt": "s", "temperature": 0.5, "n": 2, "best_of": 3},
    {"prompt": [1, 2, 3], "echo": True, "max_tokens": 4},
    {"prompt": [[1, 2], [3]], "logprobs": 2, "stream": True},
    {"prompt": "x", "echo": True, "logprobs": True, "max_tokens": 1},  # scores the prompt
    {"prompt": "x", "echo": True, "max_tokens": 0},  # scores the prompt too
]


@pytest.mark.parametrize("body", COMPLETIONS)
def test_a_completions_prompts_and_salt_are_the_daemons(body: dict) -> None:
    req = parse_completion(dict(body), [MODEL])
    expected = None if req.params.prompt_logprobs is not None else (req.prompts, req.cache_salt)
    assert completion_prompts(dict(body)) == expected


def test_a_completions_other_fields_are_not_read_and_a_bad_prompt_is_refused() -> None:
    body = {"prompt": "x", "temperature": -1, "suffix": "no"}
    with pytest.raises(ApiError):
        parse_completion(dict(body), [MODEL])
    assert completion_prompts(body) == (["x"], None)
    for bad_body in ({"prompt": []}, {"prompt": [1, "a"]}, {"prompt": "x", "logprobs": 99}, {}):
        for parse in (lambda b: parse_completion(b, [MODEL]), completion_prompts):
            with pytest.raises(ApiError):
                parse(dict(bad_body))


def test_the_reader_predicts_a_body_that_names_no_model() -> None:
    """A body without "model" runs on the pod's first served model: its prompt is keyed too (the daemon's
    whole parser, given no served names, refused it, and such bodies were routed by load)."""
    reader = PromptReader(None)
    try:
        chat = reader.read("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]})
        completion = reader.read("/v1/completions", {"prompt": "Once upon a time", "max_tokens": 4})
    finally:
        reader.close()
    assert chat is not None and chat.model is None and chat.token_ids[0]
    assert completion is not None and completion.token_ids == [
        reader.encoder.encode("Once upon a time", True)
    ]
