"""Malformed requests: each gets a 4xx with OpenAI's error JSON naming the field; the server stays up."""

from __future__ import annotations

import pytest

from kvpilot.protocol.kv_transfer import PREFILL_ASK
from support.servers import MODEL, Server

pytestmark = pytest.mark.timeout(300)

C, CH = "/v1/completions", "/v1/chat/completions"
OK_MSG = [{"role": "user", "content": "hi"}]
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}
PD_PREFILL = PREFILL_ASK
# what a vLLM prefill pod answers, handed on to the decode pod
PD_DECODE = {
    "do_remote_prefill": True,
    "remote_block_ids": [1, 2],
    "remote_host": "10.0.0.1",
    "remote_port": 5600,
}


def comp(**fields: object) -> dict:
    return {"model": MODEL, "prompt": "hi", "max_tokens": 1, **fields}


def chat(**fields: object) -> dict:
    return {"model": MODEL, "messages": OK_MSG, "max_tokens": 1, **fields}


# (id, method, path, body, status, param)
CASES = [
    ("not-json", "POST", C, b"{this is not json", 400, None),
    ("invalid-utf8", "POST", C, b'{"prompt": "\xff\xfe"}', 400, None),
    ("empty-body", "POST", C, b"", 400, None),
    ("json-array", "POST", C, b"[1, 2]", 400, None),
    ("json-nested-too-deep", "POST", C, b"[" * 100000, 400, None),
    ("lone-surrogate-prompt", "POST", C, b'{"prompt": "a\\ud800b", "max_tokens": 1}', 400, "prompt"),
    ("lone-surrogate-cache-salt", "POST", C, b'{"prompt": "a", "cache_salt": "\\udfff"}', 400, "cache_salt"),
    (
        "lone-surrogate-chat",
        "POST",
        CH,
        b'{"messages": [{"role": "user", "content": "\\ud83d"}]}',
        400,
        "messages",
    ),
    ("json-nan", "POST", C, b'{"prompt": "hi", "temperature": NaN}', 400, None),
    ("unknown-model", "POST", C, comp(model="gpt-17"), 404, "model"),
    ("model-not-string", "POST", C, comp(model=5), 400, "model"),
    ("missing-prompt", "POST", C, {"model": MODEL}, 400, "prompt"),
    ("prompt-number", "POST", C, comp(prompt=42), 400, "prompt"),
    ("prompt-empty-string", "POST", C, comp(prompt=""), 400, "prompt"),
    ("prompt-empty-list", "POST", C, comp(prompt=[]), 400, "prompt"),
    ("prompt-mixed-list", "POST", C, comp(prompt=["a", 1]), 400, "prompt"),
    ("prompt-negative-token", "POST", C, comp(prompt=[1, -5]), 400, "prompt"),
    ("prompt-token-out-of-vocab", "POST", C, comp(prompt=[10**9]), 400, "prompt"),
    ("prompt-too-long", "POST", C, comp(prompt="word " * 2000), 400, "prompt"),
    ("max-tokens-zero", "POST", C, comp(max_tokens=0), 400, "max_tokens"),
    ("max-tokens-string", "POST", C, comp(max_tokens="8"), 400, "max_tokens"),
    ("max-tokens-bool", "POST", C, comp(max_tokens=True), 400, "max_tokens"),
    ("max-tokens-float", "POST", C, comp(max_tokens=2.5), 400, "max_tokens"),
    ("max-tokens-beyond-context", "POST", C, comp(max_tokens=100000), 400, "max_tokens"),
    ("temperature-negative", "POST", C, comp(temperature=-1), 400, "temperature"),
    ("temperature-string", "POST", C, comp(temperature="hot"), 400, "temperature"),
    ("top-p-zero", "POST", C, comp(top_p=0), 400, "top_p"),
    ("top-p-above-one", "POST", C, comp(top_p=1.5), 400, "top_p"),
    ("top-k-negative", "POST", C, comp(top_k=-7), 400, "top_k"),
    ("seed-string", "POST", C, comp(seed="x"), 400, "seed"),
    ("n-too-many", "POST", C, comp(n=17), 400, "n"),
    ("best-of-below-n", "POST", C, comp(n=3, best_of=2), 400, "best_of"),
    ("best-of-streamed", "POST", C, comp(n=1, best_of=2, stream=True), 400, "best_of"),
    ("unknown-extension", "POST", C, comp(guided_json={"type": "object"}), 400, "guided_json"),
    ("chat-unknown-extension", "POST", CH, chat(guided_regex="a+"), 400, "guided_regex"),
    ("chat-top-logprobs-alone", "POST", CH, chat(top_logprobs=2), 400, "top_logprobs"),
    ("chat-top-logprobs-too-many", "POST", CH, chat(logprobs=True, top_logprobs=21), 400, "top_logprobs"),
    ("stop-token-ids-too-many", "POST", C, comp(stop_token_ids=list(range(257))), 400, "stop_token_ids"),
    ("repetition-penalty-zero", "POST", C, comp(repetition_penalty=0), 400, "repetition_penalty"),
    ("min-p-above-one", "POST", C, comp(min_p=1.5), 400, "min_p"),
    ("min-tokens-above-max", "POST", C, comp(min_tokens=5, max_tokens=2), 400, "min_tokens"),
    ("stream-string", "POST", C, comp(stream="yes"), 400, "stream"),
    (
        "stream-options-without-stream",
        "POST",
        C,
        comp(stream_options={"include_usage": True}),
        400,
        "stream_options",
    ),
    ("stop-number", "POST", C, comp(stop=5), 400, "stop"),
    ("stop-empty-string", "POST", C, comp(stop=[""]), 400, "stop"),
    ("echo-string", "POST", C, comp(echo="yes"), 400, "echo"),
    ("logprobs-too-many", "POST", C, comp(logprobs=21), 400, "logprobs"),
    ("cache-salt-number", "POST", C, comp(cache_salt=7), 400, "cache_salt"),
    ("cache-salt-too-long", "POST", C, comp(cache_salt="s" * 4097), 400, "cache_salt"),
    ("weight-version-too-long", "POST", CH, chat(weight_version="v" * 4097), 400, "weight_version"),
    ("presence-penalty", "POST", C, comp(presence_penalty=1.0), 400, "presence_penalty"),
    ("chat-missing-messages", "POST", CH, {"model": MODEL}, 400, "messages"),
    ("chat-messages-empty", "POST", CH, chat(messages=[]), 400, "messages"),
    ("chat-messages-object", "POST", CH, chat(messages={"role": "user"}), 400, "messages"),
    (
        "chat-bad-role",
        "POST",
        CH,
        chat(messages=[{"role": "wizard", "content": "hi"}]),
        400,
        "messages[0].role",
    ),
    (
        "chat-content-number",
        "POST",
        CH,
        chat(messages=[{"role": "user", "content": 3}]),
        400,
        "messages[0].content",
    ),
    (
        "chat-image-part",
        "POST",
        CH,
        chat(messages=[{"role": "user", "content": [{"type": "image_url"}]}]),
        400,
        "messages[0].content",
    ),
    (
        "chat-max-completion-tokens-zero",
        "POST",
        CH,
        chat(max_completion_tokens=0),
        400,
        "max_completion_tokens",
    ),
    (
        "chat-max-completion-tokens-beyond-context",
        "POST",
        CH,
        chat(max_completion_tokens=10**6),
        400,
        "max_completion_tokens",
    ),
    ("chat-missing-role", "POST", CH, chat(messages=[{"content": "hi"}]), 400, "messages[0].role"),
    ("stop-too-many", "POST", C, comp(stop=[str(i) for i in range(17)]), 400, "stop"),
    ("too-many-prompts", "POST", C, comp(prompt=["hi"] * 65), 400, "prompt"),
    ("chat-forced-tool", "POST", CH, chat(tools=[TOOL], tool_choice="required"), 400, "tool_choice"),
    (
        "chat-named-tool",
        "POST",
        CH,
        chat(tools=[TOOL], tool_choice={"type": "function", "function": {"name": "f"}}),
        400,
        "tool_choice",
    ),
    ("logit-bias", "POST", C, comp(logit_bias={"1": 5}), 400, "logit_bias"),
    ("chat-hidden-states", "POST", CH, chat(return_hidden_states=True), 400, "return_hidden_states"),
    ("beam-search", "POST", C, comp(use_beam_search=True), 400, "use_beam_search"),
    # what vllm-router 0.1.17's --vllm-pd-disaggregation adds to the prefill request (its vllm_pd_router.rs)
    ("pd-prefill", "POST", CH, chat(kv_transfer_params=PD_PREFILL), 400, "kv_transfer_params"),
    ("pd-decode", "POST", C, comp(kv_transfer_params=PD_DECODE), 400, "kv_transfer_params"),
    (
        "chat-continue-and-prompt",
        "POST",
        CH,
        chat(continue_final_message=True, add_generation_prompt=True),
        400,
        "continue_final_message",
    ),
    ("chat-reasoning-not-bool", "POST", CH, chat(separate_reasoning="yes"), 400, "separate_reasoning"),
    ("no-stop-trim-not-bool", "POST", C, comp(no_stop_trim=1), 400, "no_stop_trim"),
    ("chat-json-mode", "POST", CH, chat(response_format={"type": "json_object"}), 400, "response_format"),
    ("chat-unknown-model", "POST", CH, chat(model="nope"), 404, "model"),
    (
        "chat-too-long",
        "POST",
        CH,
        chat(messages=[{"role": "user", "content": "word " * 2000}]),
        400,
        "messages",
    ),
    ("unknown-route", "GET", "/v1/embeddings", None, 404, None),
    ("wrong-method", "GET", C, None, 405, None),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_malformed_request(server: Server, case: tuple) -> None:
    _, method, path, body, status, param = case
    r = server.request(method, path, body)
    assert r.status == status, r.body
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["message"] and isinstance(err["type"], str)
    assert err["param"] == param
    assert "Traceback" not in err["message"] and 'File "' not in err["message"]


def test_oversized_body_is_413(server: Server) -> None:
    r = server.request("POST", C, b'{"prompt": "' + b"a" * (5 << 20) + b'"}')
    assert r.status == 413
    assert r.json()["error"]["code"] == "request_too_large"


def test_still_healthy_and_serving_after_errors(server: Server) -> None:
    assert len(CASES) >= 30
    assert server.request("GET", "/health").status == 200
    r = server.request("POST", C, comp(max_tokens=2, temperature=0))
    assert r.status == 200 and r.json()["usage"]["completion_tokens"] >= 1


def test_tiny_temperature_is_greedy_and_harmless(server: Server) -> None:
    # 1e-300 overflows logits / t to inf in float32; it must neither fail the engine nor differ from greedy.
    greedy = server.request("POST", C, comp(max_tokens=3, temperature=0)).json()["choices"][0]["text"]
    r = server.request("POST", C, comp(max_tokens=3, temperature=1e-300))
    assert r.status == 200 and r.json()["choices"][0]["text"] == greedy
    assert server.request("GET", "/health").status == 200


def test_messages_name_the_field(server: Server) -> None:
    err = server.request("POST", C, comp(top_p=1.5)).json()["error"]
    assert err["param"] == "top_p" and "top_p" in err["message"] and "1" in err["message"]
    err = server.request("POST", CH, chat(messages=[{"role": "wizard", "content": "x"}])).json()["error"]
    assert "messages[0].role" in err["message"] and "user" in err["message"]


def test_openapi_schema_describes_the_routes(server: Server) -> None:
    r = server.request("GET", "/openapi.json")
    assert r.status == 200
    doc = r.json()
    assert doc["openapi"].startswith("3.") and {"/v1/completions", "/v1/chat/completions"} <= set(
        doc["paths"]
    )
    fields = doc["components"]["schemas"]["CompletionRequest"]["properties"]
    assert {"prompt", "logprobs", "echo", "best_of", "repetition_penalty", "min_tokens"} <= set(fields)
    assert "ChatMessage" in doc["components"]["schemas"]
