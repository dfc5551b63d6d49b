"""kvpilot's router in front of real daemons serving LoRA adapters: a request naming an adapter goes only to
pods that serve it, lands where that adapter's prefix is cached, and the router's prediction (keys with the
adapter's identity, as each pod's /health names it) equals what the pod served from its cache."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from kvpilot.router.kv.lora_adapters import MAX_ADAPTERS, adapters_from_health
from support.servers import Fleet, Server, start_daemon, start_router, stop_fleet

SYSTEM = (
    "You are the support assistant of a bicycle repair shop in a small town. The shop fixes brakes, gears "
    "and wheels, sells tyres and lights, and rents bikes by the day. Answer customers briefly and kindly."
)


@pytest.fixture(scope="module")
def lora_fleet(tmp_path_factory: pytest.TempPathFactory, lora_adapters: dict[str, Path]) -> Iterator[Fleet]:
    """Two daemons serving both adapters and one serving none, behind one prefix-aware router."""
    tmp = tmp_path_factory.mktemp("lora-fleet")
    flags = ["--enable-lora", "--lora-modules", *(f"{n}={p}" for n, p in lora_adapters.items())]
    daemons: list[Server] = []
    router = None
    try:
        daemons += [start_daemon(tmp, *flags), start_daemon(tmp, *flags), start_daemon(tmp)]
        router = start_router(tmp, [d.url for d in daemons])
        yield Fleet(daemons, router)
    finally:
        stop_fleet(router, daemons)


def ask(fleet: Fleet, model: str, user: str) -> tuple[str, int]:
    c = openai.OpenAI(base_url=fleet.router.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    raw = c.chat.completions.with_raw_response.create(
        model=model,
        messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}],
        max_tokens=2,
        temperature=0,
    )
    return raw.headers["x-kvpilot-pod"], raw.parse().usage.prompt_tokens_details.cached_tokens or 0


def test_an_adapters_prompts_stick_to_a_pod_serving_it_and_are_predicted_exactly(lora_fleet: Fleet) -> None:
    fleet = lora_fleet
    plain = f"127.0.0.1:{fleet.daemons[2].port}"
    m0 = fleet.router.metrics()
    before = fleet.router.indexed()
    first, cached = ask(fleet, "every-layer", "When do you open?")
    assert first != plain and cached == 0
    fleet.router.wait_indexed(first, before)
    for user in ("How much is a tyre?", "Do you fix brakes?", "Can I rent a bike?"):
        pod, cached = ask(fleet, "every-layer", user)
        assert pod == first and cached >= 48, (pod, first, cached)
    m = fleet.router.metrics()
    key = f'kvpilot_router_predicted_cached_tokens_total{{pod="{first}"}}'
    reported = key.replace("predicted", "reported")
    assert m[key] - m0.get(key, 0) == m[reported] - m0.get(reported, 0) > 0
    # The other adapter's keys differ: the same prompt is predicted no hit for it.
    m1 = fleet.router.metrics()
    pod, cached = ask(fleet, "attention-only", "When do you open?")
    assert pod != plain and cached == 0
    assert fleet.router.metrics().get(key.replace(first, pod), 0) == m1.get(key.replace(first, pod), 0)


def test_a_pods_health_names_its_adapters_identity_and_hostile_entries_are_left_out() -> None:
    digest = "ab" * 32
    body = {
        "weight_version": "initial",
        "lora_adapters": {
            "ok": digest,
            "short": "abc",
            "": digest,
            "x" * 300: digest,
            "upper": digest.upper(),
        },
    }
    got = adapters_from_health(json.dumps(body).encode())
    assert list(got) == ["ok"] and got["ok"].digest == digest
    many = {"lora_adapters": {f"a{i}": digest for i in range(MAX_ADAPTERS + 50)}}
    assert len(adapters_from_health(json.dumps(many).encode())) == MAX_ADAPTERS
    for raw in (None, b"[1]", b"not json", b'{"lora_adapters": [1, 2]}'):
        assert adapters_from_health(raw) == {}
