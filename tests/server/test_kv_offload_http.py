"""The offload tiers through a real `kvpilot serve`: a prompt pushed out of a small KV cache comes back as
`cached_tokens` from host memory and disk, /prefix_cache and /metrics show each tier, the KV events name
the tier as vLLM's `medium`, and a reset clears every tier (reset_external=false is refused)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest
import zmq.asyncio

from kvpilot.kv.events import decode_batch
from kvpilot.router.kv.replay import fetch_replay
from support.procs import free_port, settled
from support.servers import ADMIN_TOKEN, Server, start_server, stop_server

pytestmark = pytest.mark.timeout(300)

# Four unrelated prompts of ~150 tokens: two fill the 24-block (384-token) KV cache.
PROMPTS = [f"Topic {i}. " + f"{word} " * 140 for i, word in enumerate(["apple", "river", "stone", "cloud"])]
HOST_BLOCKS = 8  # of the default model's fp32 KV (720 KiB each): the rest spills to disk


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, str]]:
    tmp = tmp_path_factory.mktemp("offload")
    replay = f"tcp://127.0.0.1:{free_port()}"
    srv = start_server(
        tmp,
        "--num-gpu-blocks-override",
        "24",
        "--max-model-len",
        "384",
        "--kv-offloading-size",
        str(HOST_BLOCKS * 737_280 / 2**30),
        "--kv-offloading-dir",
        str(tmp / "kv"),
        "--kv-events-endpoint",
        f"tcp://127.0.0.1:{free_port()}",
        "--kv-events-replay-endpoint",
        replay,
        token=ADMIN_TOKEN,
    )
    yield srv, replay
    stop_server(srv)
    assert "Traceback" not in srv.log(), srv.log()[-4000:]


def cached_tokens(server: Server, prompt: str) -> int:
    r = server.request("POST", "/v1/completions", {"prompt": prompt, "max_tokens": 2, "temperature": 0})
    assert r.status == 200, r.body
    return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def replayed_events(endpoint: str) -> list:
    """Every KV event the daemon still buffers, fetched as kvpilot's router fetches them."""

    async def fetch() -> list:
        ctx = zmq.asyncio.Context()
        try:
            return await fetch_replay(ctx, endpoint, 0)
        finally:
            ctx.term()

    return [e for _seq, payload in asyncio.run(fetch()) for e in decode_batch(payload).events]


def test_pushed_out_prompt_comes_back_and_reset_clears_every_tier(server: tuple[Server, str]) -> None:
    srv, replay = server
    srv.reset()
    assert cached_tokens(srv, PROMPTS[0]) == 0
    for p in PROMPTS[1:]:
        assert cached_tokens(srv, p) == 0
    tiers = {t["tier"]: t for t in srv.cache()["offload"]}
    assert tiers["host"]["blocks"] == HOST_BLOCKS and tiers["disk"]["blocks"] > 0, tiers

    hit = cached_tokens(srv, PROMPTS[0])  # gone from the KV cache, back from disk
    assert hit >= 128, hit
    cache = srv.cache()
    tiers = {t["tier"]: t for t in cache["offload"]}
    assert tiers["disk"]["hit_tokens"] + tiers["host"]["hit_tokens"] == hit
    assert tiers["disk"]["loaded_blocks"] > 0

    metrics = srv.metrics()
    assert metrics['kvpilot_kv_offload_blocks{tier="host"}'] == tiers["host"]["blocks"]
    assert metrics['kvpilot_kv_offload_capacity_bytes{tier="host"}'] == HOST_BLOCKS * 737_280
    assert metrics['kvpilot_kv_offload_hits_total{tier="disk"}'] == tiers["disk"]["hit_tokens"]
    assert metrics['kvpilot_kv_offload_loaded_blocks_total{tier="disk"}'] == tiers["disk"]["loaded_blocks"]

    kv_events = srv.request("GET", "/kv_events").json()
    disk_blocks = 16 * 2**30 // 737_280  # --kv-offloading-dir-size's default
    assert kv_events["blocks_total"] == 24 + HOST_BLOCKS + disk_blocks, (
        "routers cap their index of a pod at it"
    )
    media = {(type(e).__name__, e.medium) for e in replayed_events(replay) if hasattr(e, "medium")}
    assert {("BlockStored", "CPU"), ("BlockRemoved", "CPU"), ("BlockStored", "STORAGE")} <= media, media
    assert ("BlockRemoved", "STORAGE") in media and ("BlockStored", "GPU") in media

    refused = srv.request("POST", "/reset_prefix_cache?reset_external=false", headers=srv.admin())
    assert refused.status == 400 and refused.json()["error"]["param"] == "reset_external", refused.body
    assert cached_tokens(srv, PROMPTS[1]) > 0, "the refused reset cleared nothing"

    # (settled: blocks spilled by the load above land on disk from a writer thread)
    before = settled(lambda: {t["tier"]: t["blocks"] for t in srv.cache()["offload"]}, "the tiers' blocks")
    result = srv.reset(reset_external="true")
    assert result["evicted_by_tier"]["host"] == before["host"] > 0
    assert result["evicted_by_tier"]["disk"] == before["disk"] > 0
    assert result["ranks"][0]["evicted_by_tier"] == result["evicted_by_tier"]
    assert all(t["blocks"] == 0 for t in srv.cache()["offload"])
    for p in PROMPTS:
        assert cached_tokens(srv, p) == 0, "nothing from before the reset is served, from any tier"
