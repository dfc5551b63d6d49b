"""Prefix-aware routing in front of daemons whose weights are named: the router hashes each prompt with
each pod's own weight version (its /health at first, then the version its KV events name at a swap), so
a repeated prompt lands where it is cached before and after a weight update, and no block of the old
weights is ever predicted."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest
import zmq.asyncio

from kvpilot.default_model import ensure_default_model
from kvpilot.kv.block_keys import DEFAULT_KEYS, key_scheme
from kvpilot.kv.events import AllBlocksCleared, BlockStored, EventBatch, encode_batch
from kvpilot.protocol.errors import ApiError
from kvpilot.router.fleet.pods import Pod
from kvpilot.router.kv.index import PrefixIndex
from kvpilot.router.kv.stream import PodEventStream
from kvpilot.router.kv.weight_versions import MAX_CHARS, UNKNOWN, from_health
from kvpilot.router.routing.policy import PrefixAware, hash_schemes
from kvpilot.router.routing.prompts import Prompts
from kvpilot.router.routing.version_choice import VersionChoice, pinned_version, pod_version
from support.procs import free_port, wait_for
from support.servers import (
    ADMIN_TOKEN,
    MODEL,
    RouterProc,
    Server,
    start_router,
    start_server,
    stop_fleet,
    wait_idle,
)

pytestmark = pytest.mark.timeout(600)

# A full block and a bit (about 20 tokens): a repeat is served partly from the cache.
PROMPT = "The lighthouse keeper wrote in the log that the fog came in at dusk, that the ships kept away"


def _daemon(tmp, version: str) -> Server:  # noqa: ANN001
    return start_server(
        tmp,
        "--weight-version",
        version,
        "--num-gpu-blocks-override",
        "64",
        "--kv-events-endpoint",
        f"tcp://127.0.0.1:{free_port()}",
        "--kv-events-replay-endpoint",
        f"tcp://127.0.0.1:{free_port()}",
        token=ADMIN_TOKEN,
    )


@pytest.fixture(scope="module")
def named(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[RouterProc, list[Server]]]:
    tmp = tmp_path_factory.mktemp("named")
    daemons: list[Server] = []
    router = None
    try:
        daemons += [_daemon(tmp, "v1"), _daemon(tmp, "v1")]
        router = start_router(tmp, [d.url for d in daemons])
        yield router, daemons
    finally:
        stop_fleet(router, daemons)
    for d in daemons:
        assert "Traceback" not in d.log(), d.log()[-4000:]


def _complete(router: RouterProc, prompt: str) -> tuple[str, int]:
    """(the pod that served it, its cached prompt tokens)."""
    r = router.request("POST", "/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 1})
    assert r.status == 200, r.body
    return r.headers["X-Kvpilot-Pod"], r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def _counts(router: RouterProc, pod: str) -> tuple[float, float, float, float]:
    """(prefix decisions, predicted cached tokens, reported cached tokens, stale predictions) for `pod`."""
    m = router.metrics()
    return (
        m.get(
            f'kvpilot_router_routing_decisions_total{{pod="{pod}",policy="prefix-aware",reason="prefix"}}', 0
        ),
        m.get(f'kvpilot_router_predicted_cached_tokens_total{{pod="{pod}"}}', 0),
        m.get(f'kvpilot_router_reported_cached_tokens_total{{pod="{pod}"}}', 0),
        m.get(f'kvpilot_router_stale_predictions_total{{pod="{pod}"}}', 0),
    )


def _complete_indexed(router: RouterProc, prompt: str) -> tuple[str, int]:
    """`_complete`, returning once the router has indexed the prompt's new block on the pod that served it
    (a pod's count alone may already be above zero from another test's prompt)."""
    before = router.indexed()
    pod, cached = _complete(router, prompt)
    router.wait_indexed(pod, before)
    return pod, cached


def _repeat_lands_where_cached(router: RouterProc, prompt: str) -> str:
    """Send `prompt` twice: the second goes where the first was cached, predicted exactly."""
    first, cached = _complete_indexed(router, prompt)
    assert cached == 0
    before = _counts(router, first)
    pod, cached = _complete(router, prompt)
    after = _counts(router, first)
    assert pod == first, (pod, first)
    assert cached >= 16, cached
    assert after[0] == before[0] + 1  # routed by prefix, not by load
    assert after[1] - before[1] == after[2] - before[2] == cached  # the index predicted it exactly
    assert after[3] == before[3]
    return first


def test_named_weights_route_by_prefix(named) -> None:  # noqa: ANN001
    router, daemons = named
    wait_idle(*daemons)
    assert {tuple(p["weight_versions"]) for p in router.health()["pods"]} == {("v1",)}
    _repeat_lands_where_cached(router, "Named. " + PROMPT)


def test_after_a_weight_update_only_the_new_versions_blocks_are_predicted(named) -> None:  # noqa: ANN001
    router, daemons = named
    wait_idle(*daemons)
    prompt = "Updated. " + PROMPT
    pod = _repeat_lands_where_cached(router, prompt)
    daemon = next(d for d in daemons if f"127.0.0.1:{d.port}" == pod)

    # SGLang's one-call update (same tensors, a new name): every block of v1 is gone from the index.
    r = daemon.request(
        "POST",
        "/update_weights_from_disk",
        {"model_path": str(ensure_default_model()), "weight_version": "v2"},
        headers=daemon.admin(),
        timeout=300,
    )
    assert r.status == 200, r.body
    wait_for(
        lambda: router.pod(pod)["indexed_blocks"] == 0, 30, f"the router to drop {pod}'s v1 blocks", 0.05
    )
    wait_for(lambda: router.pod(pod)["weight_versions"] == ["v2"], 30, f"{pod} to report v2", 0.05)

    # Nothing of v1 is predicted (the pod computes it all again), and the repeat lands there under v2.
    before = _counts(router, pod)
    served, cached = _complete_indexed(router, prompt)
    after = _counts(router, served)
    assert cached == 0
    if served == pod:
        assert after[1:] == before[1:], (before, after)
    again, cached = _complete(router, prompt)
    assert again == served and cached >= 16, (again, served, cached)
    final = _counts(router, served)
    assert final[0] == after[0] + 1 and final[1] - after[1] == final[2] - after[2] == cached


# ---- what a pod says about its version, checked ------------------------------------------------------
def test_the_stream_takes_each_version_where_it_stands_and_bounds_it() -> None:
    async def go() -> list:
        ctx = zmq.asyncio.Context()
        index = PrefixIndex()
        stream = PodEventStream(
            "p", "tcp://127.0.0.1:1", None, index, lambda *a: None, ctx, weight_version="v1"
        )
        k1 = key_scheme().prompt_hashes(list(range(16)), 16, None, "v1")
        seen = []
        batches = [
            [AllBlocksCleared()],  # a reset: the version stays
            [BlockStored(k1, None, [], 16), AllBlocksCleared("v2")],  # v1's block goes with the swap
            [AllBlocksCleared("x" * (MAX_CHARS + 1))],  # too long: unknown
            [AllBlocksCleared("v3")],
        ]
        for seq, events in enumerate(batches):
            await stream.on_message(seq, encode_batch(EventBatch(0.0, events)))
            seen.append((stream.weight_version, index.num_blocks(("p", 0))))
        stream.restart("test")
        seen.append(stream.weight_version)  # the pod may have restarted: /health's again
        stream.health_says("v3")  # one probe straddling a swap: the events still decide
        seen.append(stream.weight_version)
        stream.health_says("v5")
        stream.health_says("v5")  # twice in a row: the pod restarted on v5 between two probes
        seen.append(stream.weight_version)
        ctx.term()
        return seen

    assert asyncio.run(go()) == [("v1", 0), ("v2", 0), (UNKNOWN, 0), ("v3", 0), "v1", "v1", "v5"]
    assert from_health(b'{"status": "ok", "weight_version": "initial"}') is None  # unnamed weights
    assert from_health(b'{"status": "ok", "weight_version": 7}') is UNKNOWN
    assert from_health(None) is UNKNOWN  # more than its cap
    assert from_health(b"ok") is None  # a pod that names no version hashes without one


def test_a_rank_is_matched_only_with_its_own_versions_keys(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(Pod, "synced", lambda self: True)
    prompt = list(range(40))
    index = PrefixIndex()
    index.store(("a:1", 0), key_scheme().prompt_hashes(prompt[:32], 16, None, "v1"))
    index.store(("b:1", 0), key_scheme().prompt_hashes(prompt[:32], 16, None, "v2"))
    a, b = (Pod(n, f"http://{n}", True, kv_events="on", block_size=16, ranks=[0]) for n in ("a:1", "b:1"))
    a.weight_version, b.weight_version = "v1", "v1"  # b's blocks are of v2: never predicted as v1
    pa = PrefixAware(index)
    assert hash_schemes([a, b]) == {(16, "v1", DEFAULT_KEYS, None)}
    assert pa.predict([a, b], Prompts([prompt], None)) == {("a:1", 0): 32, ("b:1", 0): 0}
    b.weight_version = "v2"
    assert pa.predict([a, b], Prompts([prompt], None)) == {("a:1", 0): 32, ("b:1", 0): 32}
    b.weight_version = UNKNOWN  # b is routed by load: no prediction
    assert hash_schemes([a, b]) == {(16, "v1", DEFAULT_KEYS, None)}
    a.in_flight = 5
    d = pa.choose([a, b], Prompts([prompt], None))
    assert (d.pod, d.reason, d.predicted_cached_tokens) == (b, "load", None)


# ---- a fleet on two versions: every request to one of them -------------------------------------------
def _swap(daemon: Server, version: str) -> None:
    r = daemon.request(
        "POST",
        "/update_weights_from_disk",
        {"model_path": str(ensure_default_model()), "weight_version": version},
        headers=daemon.admin(),
        timeout=300,
    )
    assert r.status == 200, r.body


def _served_by(router: RouterProc, pin: str | None = None) -> tuple[int, str, dict]:
    body = {"model": MODEL, "prompt": "Which version? " + PROMPT, "max_tokens": 1}
    if pin is not None:
        body["weight_version"] = pin
    r = router.request("POST", "/v1/completions", body)
    return r.status, r.headers.get("X-Kvpilot-Pod", ""), r.json()


def _router_sees(router: RouterProc, versions: dict[str, list[str]]) -> None:
    wait_for(
        lambda: {p["pod"]: p["weight_versions"] for p in router.health()["pods"]} == versions,
        30,
        f"the router to see weight versions {versions}",
        0.05,
    )


def test_a_fleet_on_two_versions_serves_each_request_from_the_newest_or_the_pinned(named) -> None:  # noqa: ANN001
    router, daemons = named
    wait_idle(*daemons)
    a, b = (f"127.0.0.1:{d.port}" for d in daemons)
    _swap(daemons[0], "w-old")
    _router_sees(router, {a: ["w-old"], b: router.pod(b)["weight_versions"]})
    _swap(daemons[1], "w-new")  # seen after w-old: the newer
    _router_sees(router, {a: ["w-old"], b: ["w-new"]})
    for _ in range(6):  # prefix-aware or not, nothing goes to the older version
        status, pod, reply = _served_by(router)
        assert (status, pod, reply["system_fingerprint"].endswith("w-new")) == (200, b, True), reply
    status, pod, reply = _served_by(router, pin="w-old")
    assert (status, pod) == (200, a), reply
    status, _, reply = _served_by(router, pin="w-none")
    assert status == 409 and reply["error"]["code"] == "weight_version_mismatch", reply
    assert "w-new" in reply["error"]["message"] and "w-old" in reply["error"]["message"]
    _swap(daemons[0], "w-newest")  # a version appearing later is newer, whatever its name
    _router_sees(router, {a: ["w-newest"], b: ["w-new"]})
    assert {_served_by(router)[1] for _ in range(4)} == {a}


def test_version_choice_orders_by_first_sight_then_naturally_and_reads_pins() -> None:
    def pod(name: str, version) -> Pod:  # noqa: ANN001
        p = Pod(name, f"http://{name}", True, kv_events="on", block_size=16, ranks=[0])
        p.weight_version = version
        return p

    choice = VersionChoice()
    v2, v10, unknown = pod("a:1", "v2"), pod("b:1", "v10"), pod("c:1", UNKNOWN)
    assert choice.eligible([v2, v10, unknown], None) == [v10]  # seen together: v10 after v2
    late = pod("d:1", "v3")
    assert choice.eligible([v2, v10, late], None) == [late]  # seen later: newer than v10
    assert choice.eligible([v2, unknown], "v2") == [v2]
    assert choice.eligible([unknown], None) == [unknown]  # nothing known: whatever is ready
    assert choice.eligible([pod("e:1", None)], "initial")[0].name == "e:1"  # unnamed weights
    with pytest.raises(ApiError) as err:
        choice.eligible([v2, unknown], "v10")
    assert err.value.status == 409 and "they serve: v2" in str(err.value)
    assert pinned_version(b'{"prompt": "x", "weight_version": "v2"}') == "v2"
    assert pinned_version(b'{"prompt": "weight_version"}') is None
    assert pinned_version(b'["weight_version"]') is None and pinned_version(b'{"weight_version"') is None
    assert pod_version(pod("f:1", UNKNOWN)) is None
