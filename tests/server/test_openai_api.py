"""The official openai client against a real server: sync and async, streaming and not."""

from __future__ import annotations

import asyncio

import openai
import pytest

from kvpilot.protocol.limits import MAX_SCOPE_CHARS
from support.servers import MODEL, Server, stream_with_usage

pytestmark = pytest.mark.timeout(300)

PROMPT = "The capital of France is"
CHAT = [{"role": "user", "content": "Name three colors."}]


@pytest.fixture(scope="module")
def aclient(server: Server) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def test_models(client: openai.OpenAI) -> None:
    ids = [m.id for m in client.models.list().data]
    assert ids == [MODEL]


def test_completion_stream_matches_non_stream(client: openai.OpenAI) -> None:
    full = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0)
    choice = full.choices[0]
    assert choice.text.strip() and choice.finish_reason in ("stop", "length")
    assert full.usage.completion_tokens <= 8
    assert full.usage.prompt_tokens_details.cached_tokens >= 0  # present, 0 included

    chunks = stream_with_usage(client.completions.create, prompt=PROMPT)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == choice.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == choice.finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens


def test_chat_stream_matches_non_stream(client: openai.OpenAI) -> None:
    full = client.chat.completions.create(model=MODEL, messages=CHAT, max_completion_tokens=8, temperature=0)
    msg = full.choices[0].message
    assert msg.role == "assistant" and msg.content
    assert full.usage.prompt_tokens_details is not None

    chunks = stream_with_usage(client.chat.completions.create, messages=CHAT)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == msg.content
    usage = chunks[-1].usage
    assert usage.completion_tokens == full.usage.completion_tokens
    assert usage.prompt_tokens_details.cached_tokens > 0  # the same prompt ran just before


def test_async_clients_side_by_side(aclient: openai.AsyncOpenAI) -> None:
    async def chat() -> str:
        r = await aclient.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=8, temperature=0)
        return r.choices[0].message.content

    async def completion_stream() -> str:
        stream = await aclient.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0, stream=True
        )
        return "".join([c.choices[0].text async for c in stream])

    async def main() -> tuple[str, str]:
        return await asyncio.gather(chat(), completion_stream())

    chat_text, completion_text = asyncio.run(main())
    assert chat_text and completion_text


def test_stop_string_cuts_the_text(client: openai.OpenAI) -> None:
    ref = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0).choices[0].text
    cut = len(ref) // 2
    stop = ref[cut : cut + 2]
    assert stop.strip(), ref
    expected = ref[: ref.index(stop)]
    got = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0, stop=[stop])
    assert got.choices[0].text == expected and got.choices[0].finish_reason == "stop"
    streamed = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0, stop=stop, stream=True
    )
    chunks = list(streamed)
    assert "".join(c.choices[0].text for c in chunks) == expected
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_batched_prompts_and_token_ids(client: openai.OpenAI, server: Server) -> None:
    ids = server.request(
        "POST", "/v1/completions", {"prompt": PROMPT, "max_tokens": 4, "temperature": 0}
    ).json()
    r = client.completions.create(
        model=MODEL, prompt=[PROMPT, "One, two, three,"], max_tokens=4, temperature=0
    )
    assert [c.index for c in r.choices] == [0, 1]
    assert r.choices[0].text == ids["choices"][0]["text"]
    assert r.usage.completion_tokens == 8  # no eos within 4 tokens for these prompts
    tokens = client.completions.create(model=MODEL, prompt=[504, 3575, 282], max_tokens=2, temperature=0)
    assert tokens.usage.prompt_tokens == 3


def test_seeded_sampling_repeats(client: openai.OpenAI) -> None:
    texts = {
        client.completions.create(
            model=MODEL,
            prompt=PROMPT,
            max_tokens=6,
            temperature=1.0,
            top_p=0.9,
            seed=1234,
            extra_body={"top_k": 50},
        )
        .choices[0]
        .text
        for _ in range(2)
    }
    assert len(texts) == 1


def test_cache_salt_isolates_tenants(client: openai.OpenAI, server: Server) -> None:
    prompt = "Tenant isolation check: " + "alpha beta gamma delta " * 10

    def cached(salt: str) -> int:
        r = client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=1, temperature=0, extra_body={"cache_salt": salt}
        )
        return r.usage.prompt_tokens_details.cached_tokens

    assert cached("tenant-a") == 0
    assert cached("tenant-a") > 0
    assert cached("tenant-b") == 0


def test_the_longest_salt_a_request_may_send_can_be_reset_by_name(
    client: openai.OpenAI, server: Server
) -> None:
    """One bound (MAX_SCOPE_CHARS) for a request's salt and a scoped reset's: a salt one character longer is
    a 400 (test_errors.py), so no request can warm a scope that no reset can name."""
    salt, prompt = "s" * MAX_SCOPE_CHARS, "Longest salt check: " + "alpha beta gamma delta " * 10

    def cached() -> int:
        r = client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=1, temperature=0, extra_body={"cache_salt": salt}
        )
        return r.usage.prompt_tokens_details.cached_tokens

    cached()
    assert cached() > 0
    r = server.request("POST", "/reset_prefix_cache", {"cache_salt": salt}, headers=server.admin())
    assert r.status == 200 and r.json()["evicted_blocks"] > 0, r.body[:500]
    assert cached() == 0
