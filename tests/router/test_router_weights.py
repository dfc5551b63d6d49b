"""Prefix-aware routing in front of daemons whose weights are named: the router hashes each prompt with
each pod's own weight version (its /health at first, then the version its KV events name at a swap), so
a repeated prompt lands where it is cached before and after a weight update, and no block of the old
weights is ever predicted."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from kvpilot.daemon.engine.default_model import ensure_default_model
from support.procs import free_port
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


def _wait_blocks(router: RouterProc, pod: str, done) -> None:  # noqa: ANN001
    deadline = time.monotonic() + 30
    while not done(router.pod(pod)["indexed_blocks"]):
        assert time.monotonic() < deadline, router.health()
        time.sleep(0.05)


def _repeat_lands_where_cached(router: RouterProc, prompt: str) -> str:
    """Send `prompt` twice: the second goes where the first was cached, predicted exactly."""
    first, cached = _complete(router, prompt)
    assert cached == 0
    _wait_blocks(router, first, lambda n: n > 0)
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
    _wait_blocks(router, pod, lambda n: n == 0)
    deadline = time.monotonic() + 30
    while router.pod(pod)["weight_versions"] != ["v2"]:
        assert time.monotonic() < deadline, router.health()
        time.sleep(0.05)

    # Nothing of v1 is predicted (the pod computes it all again), and the repeat lands there under v2.
    before = _counts(router, pod)
    served, cached = _complete(router, prompt)
    after = _counts(router, served)
    assert cached == 0
    if served == pod:
        assert after[1:] == before[1:], (before, after)
    _wait_blocks(router, served, lambda n: n > 0)
    again, cached = _complete(router, prompt)
    assert again == served and cached >= 16, (again, served, cached)
    final = _counts(router, served)
    assert final[0] == after[0] + 1 and final[1] - after[1] == final[2] - after[2] == cached
