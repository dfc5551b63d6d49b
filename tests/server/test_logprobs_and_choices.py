"""Logprobs, echo, n > 1, best_of and the vLLM extensions through the official openai client and raw HTTP."""

from __future__ import annotations

import json
import math

import openai
import pytest

from support.servers import MODEL, Server

from .test_openai_api import CHAT, PROMPT

pytestmark = pytest.mark.timeout(300)


def sse(server: Server, path: str, body: dict) -> list[dict]:
    r = server.request("POST", path, {**body, "stream": True})
    assert r.status == 200, r.body
    events = [line[6:] for line in r.body.decode().splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def test_echo_scores_the_prompt_the_same_cached_or_not(client: openai.OpenAI, quiet: Server) -> None:
    quiet.reset()
    runs = [
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=0, echo=True, logprobs=2)
        for _ in range(2)
    ]  # the second finds the prompt's blocks cached: they are recomputed to score them
    for r in runs:
        (c,) = r.choices
        assert c.text == PROMPT and c.finish_reason == "length"
        lp = c.logprobs
        assert "".join(lp.tokens) == PROMPT and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        assert all(v <= 0 for v in lp.token_logprobs[1:]) and all(len(t) == 2 for t in lp.top_logprobs[1:])
        assert lp.text_offset[0] == 0 and lp.text_offset[1] == len(lp.tokens[0])
        assert r.usage.completion_tokens == 0
    assert runs[0].choices[0].logprobs.token_logprobs == runs[1].choices[0].logprobs.token_logprobs


def test_lm_eval_style_request(quiet: Server) -> None:
    ids = [[504, 3575, 282, 4649, 314], [504, 3575, 282]]
    body = {
        "model": MODEL,
        "prompt": ids,
        "max_tokens": 1,
        "temperature": 0,
        "logprobs": 1,
        "echo": True,
        "seed": 1234,
    }
    r = quiet.request("POST", "/v1/completions", body)
    assert r.status == 200, r.body
    for choice, prompt in zip(sorted(r.json()["choices"], key=lambda c: c["index"]), ids):
        lp = choice["logprobs"]
        assert len(lp["token_logprobs"]) == len(prompt) + 1  # the prompt and the one generated token
        last = lp["token_logprobs"][-1]
        assert last == max(lp["top_logprobs"][-1].values())  # greedy: the sampled token is the top one


def test_completion_logprobs_streamed_equal_non_streamed(client: openai.OpenAI, quiet: Server) -> None:
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 5, "temperature": 0, "logprobs": 3}
    full = client.completions.create(**body).choices[0]
    assert len(full.logprobs.tokens) == len(full.logprobs.top_logprobs)
    assert "".join(full.logprobs.tokens) == full.text
    streamed = [c for ev in sse(quiet, "/v1/completions", body) for c in ev["choices"]]
    tokens = [t for c in streamed if c["logprobs"] for t in c["logprobs"]["token_logprobs"]]
    assert tokens == pytest.approx(full.logprobs.token_logprobs, abs=1e-4)


def test_chat_logprobs_and_top_logprobs(client: openai.OpenAI, quiet: Server) -> None:
    r = client.chat.completions.create(
        model=MODEL, messages=CHAT, max_completion_tokens=6, temperature=0, logprobs=True, top_logprobs=3
    )
    content = r.choices[0].logprobs.content
    assert "".join(t.token for t in content) == r.choices[0].message.content
    for t in content:
        assert len(t.top_logprobs) == 3 and t.top_logprobs[0].logprob == t.logprob  # greedy
        assert bytes(t.bytes).decode("utf-8", "replace") == t.token
    prob = sum(math.exp(x.logprob) for x in content[0].top_logprobs)
    assert 0 < prob <= 1 + 1e-5
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=CHAT,
            max_completion_tokens=6,
            temperature=0,
            logprobs=True,
            top_logprobs=3,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    streamed = [
        t.logprob
        for c in chunks
        if c.choices and c.choices[0].logprobs
        for t in c.choices[0].logprobs.content
    ]
    # The second run finds the prompt cached: the same values up to float summation order.
    assert streamed == pytest.approx([t.logprob for t in content], abs=1e-4)
    assert all(c.usage is None for c in chunks[:-1]) and chunks[-1].usage.completion_tokens == 6


def test_intermediate_chunks_carry_null_usage(quiet: Server) -> None:
    events = sse(
        quiet,
        "/v1/completions",
        {"model": MODEL, "prompt": PROMPT, "max_tokens": 3, "stream_options": {"include_usage": True}},
    )
    assert all("usage" in e and e["usage"] is None for e in events[:-1])
    assert events[-1]["usage"]["completion_tokens"] == 3


def test_n_choices_with_seeds_differ_and_reproduce(client: openai.OpenAI, quiet: Server) -> None:
    def texts() -> list[str]:
        r = client.chat.completions.create(
            model=MODEL, messages=CHAT, max_completion_tokens=12, temperature=1.2, n=3, seed=5
        )
        assert [c.index for c in r.choices] == [0, 1, 2]
        return [c.message.content for c in r.choices]

    first = texts()
    assert texts() == first
    assert len(set(first)) > 1


def test_n_streamed_and_batched_prompts(quiet: Server) -> None:
    body = {"model": MODEL, "prompt": [PROMPT, "Once upon a time"], "max_tokens": 4, "temperature": 0, "n": 2}
    full = quiet.request("POST", "/v1/completions", body).json()
    assert sorted(c["index"] for c in full["choices"]) == [0, 1, 2, 3]
    by_index = {c["index"]: c["text"] for c in full["choices"]}
    assert by_index[0] == by_index[1] and by_index[2] == by_index[3]  # greedy choices agree
    assert full["usage"]["prompt_tokens"] == 5 + 4  # each prompt counted once, not per choice
    streamed: dict[int, str] = {}
    for ev in sse(quiet, "/v1/completions", body):
        for c in ev["choices"]:
            streamed[c["index"]] = streamed.get(c["index"], "") + c["text"]
    assert streamed == by_index


def test_best_of_returns_the_most_likely(client: openai.OpenAI, quiet: Server) -> None:
    r = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=6, temperature=1.0, n=2, best_of=4, seed=3, logprobs=0
    )
    assert len(r.choices) == 2 and r.usage.completion_tokens >= 4  # all four sequences ran
    sums = [sum(c.logprobs.token_logprobs) for c in r.choices]
    assert sums[0] >= sums[1] - 1e-4


def test_vllm_extensions(quiet: Server) -> None:
    base = {"model": MODEL, "prompt": PROMPT, "max_tokens": 8, "temperature": 0}
    plain = quiet.request("POST", "/v1/completions", base).json()["choices"][0]["text"]
    stop = plain.strip().split()[0]
    cut = quiet.request("POST", "/v1/completions", {**base, "stop": [stop]}).json()["choices"][0]["text"]
    kept = quiet.request(
        "POST", "/v1/completions", {**base, "stop": [stop], "include_stop_str_in_output": True}
    ).json()["choices"][0]["text"]
    assert kept == cut + stop
    penalized = quiet.request("POST", "/v1/completions", {**base, "repetition_penalty": 3.0, "min_p": 0.1})
    assert penalized.status == 200
    # min_tokens holds EOS back: ignore nothing, yet at least 6 tokens come out.
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "Say ok."}], "temperature": 0}
    short = quiet.request("POST", "/v1/chat/completions", {**chat, "max_tokens": 40}).json()
    assert short["choices"][0]["finish_reason"] == "stop"
    held = quiet.request(
        "POST",
        "/v1/chat/completions",
        {**chat, "max_tokens": 40, "min_tokens": short["usage"]["completion_tokens"] + 3},
    )
    assert held.json()["usage"]["completion_tokens"] >= short["usage"]["completion_tokens"] + 3
    # Special tokens show up only when asked for.
    special = {**chat, "max_tokens": 40, "skip_special_tokens": False, "include_stop_str_in_output": True}
    raw = quiet.request("POST", "/v1/chat/completions", special).json()["choices"][0]["message"]["content"]
    assert raw == short["choices"][0]["message"]["content"] or "<|" in raw


def test_unknown_extension_is_named(quiet: Server) -> None:
    r = quiet.request(
        "POST", "/v1/completions", {"model": MODEL, "prompt": "hi", "guided_choice": ["a", "b"]}
    )
    assert r.status == 400 and r.json()["error"]["param"] == "guided_choice"
    ok = quiet.request(
        "POST",
        "/v1/completions",
        {"model": MODEL, "prompt": "hi", "max_tokens": 1, "user": "u1", "guided_json": None},
    )
    assert ok.status == 200


def test_each_prompt_of_a_batch_gets_its_own_room(quiet: Server) -> None:
    long, short = [504] * 505, [504, 3575]  # the test server's context is 512 tokens
    body = {"model": MODEL, "prompt": [long, short], "temperature": 0, "ignore_eos": True}
    r = quiet.request("POST", "/v1/completions", body)
    assert r.status == 200, r.body
    lengths = {c["index"]: c["finish_reason"] for c in r.json()["choices"]}
    assert lengths == {0: "length", 1: "length"}
    assert r.json()["usage"]["completion_tokens"] == 7 + 16  # the long prompt's room, OpenAI's default 16
