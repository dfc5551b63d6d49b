"""The router's fleet reset proves each pod cold (`verify`, default true): a canary before and after each
pod's reset (kvpilot/fanout/verify.py), through `kvpilot router --engine vllm|sglang` over stand-ins that
model each engine's cache tiers (tests/support/engine_standin.py), and over real kvpilot daemons."""

from __future__ import annotations

from pathlib import Path

import pytest

from support.engine_standin import EngineStandin, start_standin
from support.procs import stop, wait_for
from support.servers import MODEL, Fleet, RouterProc, start_router, stop_router

pytestmark = pytest.mark.timeout(300)


@pytest.fixture
def standin(tmp_path: Path):  # noqa: ANN201 - a factory
    started: list[EngineStandin] = []

    def start(engine: str, **state: object) -> EngineStandin:
        started.append(start_standin(tmp_path, engine))
        if state:
            started[-1].set(**state)
        return started[-1]

    yield start
    for s in started:
        stop(s.proc, grace=5)


def router_for(tmp: Path, pod: EngineStandin, *extra: str) -> RouterProc:
    router = start_router(tmp, [pod.url], "--engine", pod.engine, *extra, all_pods=False)
    wait_for(lambda: all(p["ready"] for p in router.health()["pods"]), 15, "the pod ready")
    return router


def reset(router: RouterProc, query: str = "", body: dict | None = None) -> tuple[int, dict]:
    r = router.request("POST", "/reset_prefix_cache" + query, body, headers=router.admin())
    return r.status, r.json()


def test_a_busy_vllm_pod_is_retried_until_done_and_verified_cold(tmp_path: Path, standin) -> None:  # noqa: ANN001
    pod = standin("vllm", offload=True)
    router = router_for(tmp_path, pod)
    try:
        pod.set(running=1, idle_after_s=1.0)  # {"success":false} until its request finishes
        status, doc = reset(router)
        assert status == 200, doc
        (reply,) = doc["pods"]
        assert reply["success"] is True and reply["verified"] == "cold", reply
        assert reply["cleared"] == ["pool", "external"] and reply["reason"] is None, reply
        assert "found nothing cached" in reply["verify_message"], reply
        state = pod.state()
        assert state["paths"]["POST /reset_prefix_cache"] >= 2 and state["resets"] == 1, state
        # canary: fill, hit (before), check (after); it was stored again by the last one
        assert state["paths"]["POST /v1/completions"] == 3 and state["tiers"] == {"device": 1, "external": 1}
    finally:
        stop_router(router)


@pytest.mark.parametrize("how", ["query", "json"])
def test_vllm_without_reset_external_stays_warm_and_the_reset_fails(
    tmp_path: Path,
    standin,  # noqa: ANN001
    how: str,
) -> None:
    pod = standin("vllm", offload=True)
    router = router_for(tmp_path, pod)
    try:
        if how == "query":
            status, doc = reset(router, "?reset_external=false")
        else:
            status, doc = reset(router, body={"reset_external": False})
        assert status == 502, doc
        assert doc["success"] is False and pod.name in doc["error"]["message"], doc
        (reply,) = doc["pods"]
        assert reply["success"] is False and reply["verified"] == "warm", reply
        assert reply["reason"] == "StillWarm" and reply["error"].startswith("StillWarm: "), reply
        # The offload tier served the canary in its 128-token blocks (256 of the canary's 303 words), and
        # only the GPU pool was cleared: the tier the reset missed is the one not named.
        assert reply["cleared"] == ["pool"] and "tiers cleared: pool;" in reply["error"], reply
        assert "served 256 of 303 canary tokens" in reply["verify_message"], reply
        assert pod.state()["resets"] == 1
        # Not verified, the same reset is taken at the pod's word.
        status, doc = reset(router, "?reset_external=false&verify=false")
        assert status == 200 and doc["pods"][0]["verified"] is None, doc
        # With reset_external (the default) the offload tier goes too.
        status, doc = reset(router)
        assert status == 200 and doc["pods"][0]["verified"] == "cold", doc
    finally:
        stop_router(router)


def test_a_bad_verify_flag_is_a_400(tmp_path: Path, standin) -> None:  # noqa: ANN001
    pod = standin("vllm")
    router = router_for(tmp_path, pod)
    try:
        status, doc = reset(router, "?verify=maybe")
        assert status == 400 and doc["error"]["param"] == "verify", doc
        status, doc = reset(router, body={"reset_external": "no"})
        assert status == 400 and doc["error"]["param"] == "reset_external", doc
        # vLLM resets its whole cache only: a scoped reset is refused before any pod is called
        status, doc = reset(router, "?lora_name=policy")
        assert status == 400 and doc["error"]["code"] == "unsupported", doc
        assert doc["error"]["param"] == "lora_name" and "needs kvpilot pods" in doc["error"]["message"], doc
        assert "POST /reset_prefix_cache" not in pod.state()["paths"]
    finally:
        stop_router(router)


def test_vllm_without_prompt_token_details_is_unknown_not_a_failure(tmp_path: Path, standin) -> None:  # noqa: ANN001
    pod = standin("vllm", cached_tokens_reported=False)
    router = router_for(tmp_path, pod)
    try:
        status, doc = reset(router)
        assert status == 200, doc
        (reply,) = doc["pods"]
        assert reply["success"] is True and reply["verified"] == "unknown", reply
        assert "--enable-prompt-tokens-details" in reply["verify_message"], reply
        assert pod.state()["resets"] == 1
    finally:
        stop_router(router)


def test_sglang_with_hicache_storage_is_flushed_and_its_storage_cleared(tmp_path: Path, standin) -> None:  # noqa: ANN001
    pod = standin("sglang", enable_hierarchical_cache=True, hicache_storage_backend="file")
    router = router_for(tmp_path, pod)
    try:
        status, doc = reset(router)
        assert status == 200, doc
        (reply,) = doc["pods"]
        assert reply["verified"] == "cold" and reply["cleared"] == ["pool", "host", "storage"], reply
        paths = pod.state()["paths"]
        assert paths["POST /flush_cache"] == 1 and paths["POST /clear_hicache_storage_backend"] == 1, paths
        assert paths["GET /server_info"] >= 1, paths
    finally:
        stop_router(router)


def test_sglang_storage_tier_serves_a_flushed_prompt_until_cleared(standin) -> None:  # noqa: ANN001
    """The stand-in itself: what makes the storage clear needed (SGLang 9750)."""
    import http.client
    import json

    pod = standin("sglang", enable_hierarchical_cache=True, hicache_storage_backend="file")

    def call(method: str, path: str, body: dict | None = None) -> tuple[int, str]:
        conn = http.client.HTTPConnection("127.0.0.1", pod.port, timeout=10)
        try:
            conn.request(method, path, json.dumps(body) if body is not None else None)
            resp = conn.getresponse()
            return resp.status, resp.read().decode()
        finally:
            conn.close()

    def cached() -> int:
        status, text = call("POST", "/v1/completions", {"model": "m", "prompt": "a b c d e", "max_tokens": 1})
        return json.loads(text)["usage"]["prompt_tokens_details"]["cached_tokens"]

    assert (cached(), cached()) == (0, 4)
    assert call("POST", "/flush_cache")[0] == 200
    assert cached() == 4  # from storage
    status, text = call("POST", "/clear_hicache_storage_backend")
    assert status == 200 and text.endswith("Hierarchical cache storage backend cleared.\n"), text
    assert call("POST", "/flush_cache")[0] == 200
    assert cached() == 0
    pod.set(storage_clear_fails=True)
    assert call("POST", "/clear_hicache_storage_backend")[0] == 400


def test_the_router_over_kvpilot_daemons_answers_verified_cold(quiet_fleet: Fleet) -> None:
    router = quiet_fleet.router
    status, doc = reset(router)
    assert status == 200, doc
    assert {p["pod"] for p in doc["pods"]} == {f"127.0.0.1:{d.port}" for d in quiet_fleet.daemons}
    for reply in doc["pods"]:
        assert reply["success"] and reply["verified"] == "cold" and reply["reason"] is None, reply
        assert "pool" in reply["cleared"], reply
        assert "found nothing cached" in reply["verify_message"], reply


def test_a_scoped_reset_through_the_router_leaves_the_rest_of_the_fleet_warm(quiet_fleet: Fleet) -> None:
    """?cache_salt=...: each pod resets that salt's blocks, its canary (run under the salt) proves them cold,
    the router's index drops them from the pods' BlockRemoved events before it answers, and a prompt
    without the salt is still indexed and still served from cache."""
    import openai

    router = quiet_fleet.router
    client = openai.OpenAI(base_url=router.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    prompt = "A scoped reset's prompt, long enough to fill a few blocks of the prefix cache. " * 8

    def cached(salt: str | None) -> int:
        out = client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=1, extra_body={"cache_salt": salt} if salt else None
        )
        return out.usage.prompt_tokens_details.cached_tokens or 0

    def indexed() -> int:
        return sum(p["indexed_blocks"] for p in router.health()["pods"])

    for salt in ("tenant-x", None, "tenant-x", None):
        cached(salt)
    assert cached("tenant-x") >= 32 and cached(None) >= 32
    wait_for(lambda: indexed() >= 8, 30, "both prompts' blocks indexed")
    before = indexed()

    # Without the canary first (its blocks, under the salt, would be counted after the reset again).
    status, doc = reset(router, "?cache_salt=tenant-x&verify=false")
    assert status == 200 and doc["scope"] == {"cache_salt": "tenant-x"}, doc
    assert all(reply["index"] == "removed" for reply in doc["pods"]), doc
    after = indexed()
    assert 4 <= after <= before - 4, (before, after)  # tenant-x's blocks went, the unsalted ones stayed
    assert cached(None) >= 32 and cached("tenant-x") == 0

    cached("tenant-x")
    status, doc = reset(router, body={"cache_salt": "tenant-x"})
    assert status == 200, doc
    for reply in doc["pods"]:
        assert reply["success"] and reply["verified"] == "cold" and reply["index"] == "removed", reply
    assert cached(None) >= 32 and cached("tenant-x") == 0


def test_sglang_storage_that_cannot_clear_fails_the_reset_naming_the_call(tmp_path: Path, standin) -> None:  # noqa: ANN001
    """SGLang answers 400 when its storage backend does not clear: retried as busy (SGLang 21413) until the
    reset's deadline, then the pod fails with that call named, and its canary is never checked."""
    pod = standin(
        "sglang", enable_hierarchical_cache=True, hicache_storage_backend="file", storage_clear_fails=True
    )
    router = router_for(tmp_path, pod, "--reset-timeout", "3")
    try:
        status, doc = reset(router)
        assert status == 502, doc
        (reply,) = doc["pods"]
        assert reply["status"] == 400 and "/clear_hicache_storage_backend" in reply["error"], reply
        assert reply["verified"] is None and reply["reason"] is None, reply
        assert reply["cleared"] == ["pool", "host"], reply  # the flush went through; the storage did not
        paths = pod.state()["paths"]
        assert paths["POST /flush_cache"] == 1 and paths["POST /clear_hicache_storage_backend"] >= 2, paths
    finally:
        stop_router(router)
