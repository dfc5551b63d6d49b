"""kvpilot.protocol.requests.chat_prompt, the router's read of a chat: the same prompt and salt as the
daemon's parse_chat on every body both take, whatever else the body holds; nothing it does not need."""

from __future__ import annotations

import pytest

from kvpilot.protocol.errors import ApiError
from kvpilot.protocol.requests import chat_prompt, parse_chat

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


@pytest.mark.parametrize("body", BODIES)
def test_the_prompt_and_salt_are_the_daemons(body: dict) -> None:
    chat = parse_chat(dict(body), [MODEL])
    assert chat_prompt(dict(body)) == (chat.prompt, chat.generate.cache_salt)


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
    ],
)
def test_a_prompt_the_daemon_refuses_is_refused(body: dict) -> None:
    for parse in (lambda b: parse_chat(b, [MODEL]), chat_prompt):
        with pytest.raises(ApiError):
            parse(dict(body))
