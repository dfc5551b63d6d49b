"""Pinned prefixes over HTTP (vLLM PRs 27046/27097's names): `--enable-pinned-prefix`, a request's
`pin_prefix`, `POST /unpin_all_pinned_prefixes`; pins outlive an evicting load, stop at the cap, and a reset
drops them. Run in one engine (LRU) and over two data-parallel ranks (LFU), whose greedy answers are the
unpinned default server's."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from support.servers import ADMIN_TOKEN, Server, start_server, stop_server

pytestmark = pytest.mark.timeout(600)

BLOCKS = 32  # per rank: a load of 10 prompts of 4 blocks evicts every unpinned block
SYSTEM = "You are the support assistant of a lighthouse museum. " * 8  # about 6 blocks of 16 tokens
RANK0 = {"X-data-parallel-rank": "0"}


@pytest.fixture(scope="module", params=[("1", "lru"), ("2", "lfu")], ids=["one-engine-lru", "two-ranks-lfu"])
def pinned_server(request, tmp_path_factory) -> Iterator[Server]:  # noqa: ANN001
    dp, policy = request.param
    srv = start_server(
        tmp_path_factory.mktemp("pinned"),
        "--enable-pinned-prefix",
        "--pinned-prefix-cap-ratio",
        "0.25",  # 8 blocks
        "--prefix-cache-eviction-policy",
        policy,
        "--num-gpu-blocks-override",
        str(BLOCKS),
        "-dp",
        dp,
        token=ADMIN_TOKEN,
    )
    yield srv
    stop_server(srv)
    assert "Traceback" not in srv.log(), srv.log()[-4000:]


def chat(server: Server, content: str, **extra: object) -> dict:
    body = {"messages": [{"role": "user", "content": content}], "max_tokens": 4, "temperature": 0, **extra}
    r = server.request("POST", "/v1/chat/completions", body, headers=RANK0)
    assert r.status == 200, r.body
    return r.json()


def cached(reply: dict) -> int:
    return reply["usage"]["prompt_tokens_details"]["cached_tokens"]


def evict(server: Server) -> None:
    """Ten one-off prompts of about four blocks each: more than the rank's 32 blocks."""
    for i in range(10):
        chat(server, f"Load {i}: " + f"word{i} " * 50)


def unpin(server: Server, token: bool = True, query: str = "") -> tuple[int, dict]:
    r = server.request("POST", "/unpin_all_pinned_prefixes" + query, headers=server.admin() if token else {})
    return r.status, r.json()


def test_a_pinned_prompt_outlives_an_evicting_load_and_unpinning_lets_it_go(pinned_server: Server) -> None:
    srv = pinned_server
    srv.reset()
    first = chat(srv, SYSTEM, pin_prefix=True)
    pin = first["pin_prefix"]
    assert pin["pinned"] is True and pin["reason"] is None and pin["blocks"] >= 5, pin
    unpinned = "An unpinned question about the weather in the harbour. " * 6
    assert "pin_prefix" not in chat(srv, unpinned)  # only a request that asks hears of pins
    assert srv.cache()["pinned_blocks"] == pin["blocks"]
    evict(srv)
    assert cached(chat(srv, SYSTEM)) >= pin["blocks"] * 16 - 16  # all but the block its last token is in
    # evicted by the load, but for the chat template's first block, which every chat of the load shares
    assert cached(chat(srv, unpinned)) <= 16

    assert unpin(srv, token=False)[0] == 401
    assert unpin(srv, query="?cache_salt=someone-else") == (
        200,
        {
            "success": True,
            "scope": {"cache_salt": "someone-else"},
            "unpinned_blocks": 0,
            "ranks": unpin_ranks(srv),
        },
    )
    status, body = unpin(srv)
    assert status == 200 and body["unpinned_blocks"] == pin["blocks"], body
    assert srv.cache()["pinned_blocks"] == 0
    evict(srv)
    after = cached(chat(srv, SYSTEM))
    if "lru" in srv.proc.args:
        assert after <= 16  # unpinned, it was evicted like any other block
    else:  # LFU: hit twice, it outlives blocks of one-off prompts, hit never, pinned or not
        assert after >= pin["blocks"] * 16 - 16


def unpin_ranks(srv: Server) -> list[dict]:
    return [{"rank": r["rank"], "unpinned_blocks": 0} for r in srv.cache()["ranks"]]


def test_a_pin_past_the_cap_is_served_not_pinned_and_counted(pinned_server: Server) -> None:
    srv = pinned_server
    srv.reset()
    metric = "kvpilot_prefix_cache_pins_refused_total"

    def refused() -> float:
        return sum(v for k, v in srv.metrics().items() if k.startswith(metric))

    before = refused()
    long = chat(srv, "A very long tool schema. " * 45, pin_prefix=True)  # about 18 blocks: over 8
    assert long["pin_prefix"] == {"pinned": False, "blocks": 0, "reason": "cap"}
    assert long["choices"][0]["message"]["content"]  # served all the same
    assert refused() == before + 1
    assert srv.cache()["pinned_blocks"] == 0 and srv.cache()["pinned_blocks_cap"] == 8 * len(
        srv.cache()["ranks"]
    )


def test_a_reset_drops_the_pins_and_says_how_many(pinned_server: Server) -> None:
    srv = pinned_server
    srv.reset()
    pin = chat(srv, SYSTEM, pin_prefix=True)["pin_prefix"]
    assert pin["pinned"]
    reset = srv.reset()
    assert reset["unpinned_blocks"] == pin["blocks"] and srv.cache()["pinned_blocks"] == 0
    assert cached(chat(srv, SYSTEM)) == 0  # cold means cold


def test_a_streamed_pin_reports_in_its_last_chunk(pinned_server: Server) -> None:
    srv = pinned_server
    srv.reset()
    body = {"prompt": SYSTEM, "max_tokens": 3, "temperature": 0, "stream": True, "pin_prefix": True}
    r = srv.request("POST", "/v1/completions", body, headers=RANK0)
    assert r.status == 200
    events = [json.loads(line[6:]) for line in r.body.decode().splitlines() if line.startswith("data: {")]
    assert events[-1]["pin_prefix"]["pinned"] is True and events[-1]["choices"] == []
    assert all("pin_prefix" not in e for e in events[:-1])
    srv.reset()


def test_greedy_answers_are_the_default_servers(pinned_server: Server, server: Server) -> None:
    """Pins and either eviction policy change what is cached, never what is computed."""
    prompts = [SYSTEM, "Name three rivers:", "Load 3: " + "word3 " * 50]
    pinned = [chat(pinned_server, p, pin_prefix=True)["choices"][0]["message"]["content"] for p in prompts]
    evict(pinned_server)
    again = [chat(pinned_server, p)["choices"][0]["message"]["content"] for p in prompts]
    default = [chat(server, p)["choices"][0]["message"]["content"] for p in prompts]
    assert pinned == again == default
    pinned_server.reset()


def test_without_the_flag_a_pin_is_refused_as_disabled(server: Server) -> None:
    reply = chat(server, SYSTEM, pin_prefix=True)
    assert reply["pin_prefix"] == {"pinned": False, "blocks": 0, "reason": "disabled"}
    r = server.request("POST", "/v1/chat/completions", {"messages": [], "pin_prefix": "yes"})
    assert r.status == 400 and "pin_prefix" in r.body.decode()
