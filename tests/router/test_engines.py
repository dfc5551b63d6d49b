"""`kvpilot router --engine vllm|sglang` in front of stand-ins that answer as vLLM 0.33.0 and SGLang 0.5.23
do (tests/support/engine_standin.py): the fleet reset through the fan-out's engine adapters, health from each
engine's endpoint, least-load from each engine's metrics, and prefix-aware refused where no pod publishes KV
events the router can verify."""

from __future__ import annotations

import asyncio
import gzip
import logging
import time
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from kvpilot.cli.main import main
from kvpilot.engines import ENGINES
from kvpilot.router.fleet.load import parse_load, read_load
from kvpilot.router.settings import RouterSettings
from support.engine_standin import EngineStandin, start_standin
from support.procs import free_port, stop, wait_for
from support.servers import RouterProc, start_router, stop_router

pytestmark = pytest.mark.timeout(300)

VLLM = ENGINES["vllm"].load_metrics
SGLANG = ENGINES["sglang"].load_metrics

# As vLLM 0.33.0 sends it (two engines, i.e. DP=2), with the neighbours a prefix match would take.
VLLM_METRICS = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 2.0
vllm:num_requests_running{engine="1",model_name="m"} 1.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 4.0
vllm:num_requests_waiting{engine="1",model_name="m"} 0.0
# TYPE vllm:num_requests_waiting_by_reason gauge
vllm:num_requests_waiting_by_reason{engine="0",model_name="m",reason="capacity"} 4.0
vllm:num_requests_running_total{engine="0",model_name="m"} 100.0
"""


def test_every_engine_has_a_reset_adapter() -> None:
    from kvpilot.fanout.engines import ADAPTERS

    assert set(ENGINES) == set(ADAPTERS)
    assert all(ADAPTERS[name].traits is ENGINES[name] for name in ENGINES)


def test_load_is_the_sum_of_the_exact_metrics_and_unknown_when_in_doubt() -> None:
    assert parse_load(VLLM_METRICS, VLLM) == 7
    sglang = (
        'sglang:num_running_reqs{engine_type="unified",model_name="a } b \\"c\\"",tp_rank="0"} 3.0\n'
        'sglang:num_queue_reqs{model_name="m"} 2 1733040000000\n'  # a timestamp after the value
    )
    assert parse_load(sglang, SGLANG) == 5
    assert parse_load("sglang:num_running_reqs 1\n", SGLANG) is None  # no queue series: unknown
    for bad in ("NaN", "-1", "+Inf", "x", ""):
        assert parse_load(VLLM_METRICS + f"vllm:num_requests_running {bad}\n", VLLM) is None, bad
    assert parse_load(VLLM_METRICS + 'vllm:num_requests_running{engine="2" 1\n', VLLM) is None
    huge = "vllm:num_requests_running 1e308\n" * 2  # each finite, their sum not: unknown, not an error
    assert parse_load(VLLM_METRICS + huge, VLLM) is None


def test_a_pods_metrics_are_read_within_bounds() -> None:
    """An endless body, a gzip bomb and a trickle all end as an unknown load, within the bounds."""

    async def endless(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse()
        await resp.prepare(request)
        while True:
            await resp.write(b"# padding" * 1000 + b"\n")

    async def bomb(request: web.Request) -> web.Response:
        body = gzip.compress(VLLM_METRICS.encode() + b"#" * (64 << 20))  # ~64 KiB on the wire
        return web.Response(body=body, headers={"Content-Encoding": "gzip", "Content-Type": "text/plain"})

    async def trickle(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse()
        await resp.prepare(request)
        while True:
            await resp.write(b"#\n")
            await asyncio.sleep(0.2)

    async def fine(request: web.Request) -> web.Response:
        return web.Response(body=gzip.compress(VLLM_METRICS.encode()), headers={"Content-Encoding": "gzip"})

    async def run() -> list[tuple[int | None, str, float]]:
        app = web.Application()
        for name, handler in (("endless", endless), ("bomb", bomb), ("trickle", trickle), ("fine", fine)):
            app.router.add_get(f"/{name}/metrics", handler)
        runner = web.AppRunner(app, shutdown_timeout=0.5)
        await runner.setup()
        port = free_port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        out = []
        try:
            async with aiohttp.ClientSession() as session:
                for name in ("endless", "bomb", "trickle", "fine"):
                    started = time.monotonic()
                    load, why = await read_load(
                        session,
                        f"http://127.0.0.1:{port}/{name}",
                        ENGINES["vllm"],
                        max_bytes=1 << 20,
                        timeout_s=1.0,
                    )
                    out.append((load, why, time.monotonic() - started))
        finally:
            await runner.cleanup()
        return out

    endless_, bomb_, trickle_, fine_ = asyncio.run(run())
    assert endless_[:2] == bomb_[:2] == (None, "GET /metrics sent more than 1048576 bytes")
    assert trickle_[:2] == (None, "GET /metrics took longer than 1s") and trickle_[2] < 2
    assert fine_[:2] == (7, "")


def test_prefix_aware_is_refused_where_pods_publish_no_events_it_follows(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert (
        RouterSettings().policy
        == RouterSettings(engine="vllm", policy="prefix-aware").policy
        == "prefix-aware"
    )
    assert RouterSettings(engine="vllm").policy == RouterSettings(engine="sglang").policy == "least-load"
    monkeypatch.delenv("KVPILOT_ADMIN_TOKEN", raising=False)
    bad = [
        (
            ["--engine", "sglang", "--policy", "prefix-aware"],
            "--policy prefix-aware needs pods whose KV events",
        ),
        (
            ["--engine", "vllm", "--kv-events-block-size", "0"],
            "--kv-events-block-size must be between 1 and 65536",
        ),
        (["--engine", "vllm", "--kv-events-hash-seed", "s" * 257], "a hash seed has at most 256 characters"),
        (["--kv-event-source", "http://a:1=tcp://a:5557"], "--kv-event-source is for --engine vllm"),
        (["--engine", "vllm", "--kv-event-source", "http://a:1"], "expected URL=ENDPOINT"),
        (["--engine", "vllm", "--kv-event-source", "http://a:1=udp://a:1"], "is not a tcp://HOST:PORT"),
        (["--engine", "vllm", "--kv-event-source", "http://a:x=tcp://a:1"], "is not an http://HOST:PORT"),
        # repeated as vllm-router takes it, and named as --endpoints names pods (host:port, any case)
        (
            [
                "--engine",
                "vllm",
                "--kv-event-source",
                "http://a:1=tcp://a:1",
                "--kv-event-source",
                "A:1=tcp://b:1",
            ],
            "names a:1 twice",
        ),
    ]
    for flags, message in bad:
        caplog.clear()
        with caplog.at_level(logging.ERROR):
            assert main(["router", *flags, "--endpoints", "http://a:1"]) == 2
        errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
        assert len(errors) == 1 and message in errors[0], errors
    with pytest.raises(SystemExit) as refused:  # not one of vLLM's cryptographic schemes: argparse's own 2
        main(["router", "--engine", "vllm", "--kv-events-hash-algo", "xxhash", "--endpoints", "http://a:1"])
    assert refused.value.code == 2


# ---- a router in front of stand-ins ------------------------------------------------------------------
def router_for(tmp: Path, pods: list[EngineStandin], *extra: str) -> RouterProc:
    router = start_router(tmp, [p.url for p in pods], "--engine", pods[0].engine, *extra, all_pods=False)
    wait_for(lambda: all(p["ready"] for p in router.health()["pods"]), 15, "every pod ready")
    return router


@pytest.fixture
def standins(tmp_path: Path):  # noqa: ANN201 - a factory
    started: list[EngineStandin] = []

    def start(engine: str, *args: str) -> EngineStandin:
        started.append(start_standin(tmp_path, engine, *args))
        return started[-1]

    yield start
    for s in started:
        stop(s.proc, grace=5)


def reset(router: RouterProc, query: str = ""):  # noqa: ANN201
    return router.request("POST", "/reset_prefix_cache" + query, headers=router.admin())


def chat(router: RouterProc) -> str:
    body = {"model": "standin-model", "messages": [{"role": "user", "content": "Hi"}]}
    r = router.request("POST", "/v1/chat/completions", body)
    assert r.status == 200, r.body
    return r.headers["X-Kvpilot-Pod"]


def test_vllm_fleet_reset_names_the_pod_that_refused(tmp_path: Path, standins) -> None:  # noqa: ANN001
    a, b = standins("vllm"), standins("vllm")
    router = router_for(tmp_path, [a, b])
    try:
        h = router.health()
        assert h["engine"] == "vllm" and h["policy"] == "least-load"
        assert [p["kv_events"] for p in h["pods"]] == ["off", "off"]  # GET /kv_event_sources: {}
        b.set(running=2)  # vLLM 0.33 answers 200 {"success":false} while running requests hold blocks
        r = reset(router)
        assert r.status == 502, r.body
        doc = r.json()
        assert doc["success"] is False and doc["error"]["code"] == "reset_failed"
        assert b.name in doc["error"]["message"] and a.name not in doc["error"]["message"]
        by_pod = {p["pod"]: p for p in doc["pods"]}
        assert by_pod[a.name]["success"] is True and by_pod[a.name]["status"] == 200
        assert by_pod[b.name]["success"] is False and by_pod[b.name]["status"] == 200
        assert "success: false" in by_pod[b.name]["error"]
        assert (a.state()["resets"], b.state()["resets"]) == (1, 0)
        assert "fleet reset failed on " + b.name in router.log()
        # reset_running_requests=true lets vLLM preempt them: every pod resets.
        r = reset(router, "?reset_running_requests=true")
        assert r.status == 200 and r.json()["success"] is True, r.body
        assert b.state()["resets"] == 1
        # Neither pod was asked for kvpilot's KV event sockets.
        assert not any("/kv_events" in path for s in (a, b) for path in s.state()["paths"])
    finally:
        stop_router(router)


def test_vllm_without_dev_mode_is_a_failed_reset_that_says_why(tmp_path: Path, standins) -> None:  # noqa: ANN001
    a, b = standins("vllm"), standins("vllm", "--no-dev-mode")
    router = router_for(tmp_path, [a, b])
    try:
        r = reset(router)
        assert r.status == 502, r.body
        pod = next(p for p in r.json()["pods"] if p["pod"] == b.name)
        assert pod["status"] == 404 and "VLLM_SERVER_DEV_MODE=1" in pod["error"]
    finally:
        stop_router(router)


def test_sglang_fleet_reset_waits_out_a_busy_pod(tmp_path: Path, standins) -> None:  # noqa: ANN001
    a, b = standins("sglang"), standins("sglang")
    router = router_for(tmp_path, [a, b])
    try:
        b.set(running=1, waiting=1, idle_after_s=1.5)  # 400 "Flush cache failed." until its requests finish
        started = time.monotonic()
        r = reset(router)
        assert r.status == 200 and r.json()["success"] is True, r.body
        assert time.monotonic() - started >= 1.4
        assert b.state()["paths"]["POST /flush_cache"] >= 2 and b.state()["resets"] == 1
        assert a.state()["paths"]["POST /flush_cache"] == 1 and a.state()["resets"] == 1
        # Still busy when --reset-timeout runs out: a failure naming the pod, the busy reply as the reason.
        b.set(running=1)
        quick = start_router(
            tmp_path, [a.url, b.url], "--engine", "sglang", "--reset-timeout", "2", all_pods=False
        )
        try:
            r = reset(quick)
            assert r.status == 502 and b.name in r.json()["error"]["message"], r.body
            pod = next(p for p in r.json()["pods"] if p["pod"] == b.name)
            assert pod["status"] == 400 and "not flushed while requests run" in pod["error"]
        finally:
            stop_router(quick)
    finally:
        stop_router(router)


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_least_load_follows_each_engines_metrics(tmp_path: Path, standins, engine: str) -> None:  # noqa: ANN001
    a, b = standins(engine, "--dp", "2"), standins(engine)
    router = router_for(tmp_path, [a, b], "--policy", "least-load")
    try:
        a.set(running=3, waiting=2)  # over two DP ranks: the router sums the series
        wait_for(
            lambda: router.pod(a.name)["load"] == 5 and router.pod(b.name)["load"] == 0, 10, "loads read"
        )
        assert {chat(router) for _ in range(4)} == {b.name}
        a.set(running=0, waiting=0)
        b.set(running=4)
        wait_for(
            lambda: router.pod(a.name)["load"] == 0 and router.pod(b.name)["load"] == 4, 10, "loads read"
        )
        assert {chat(router) for _ in range(4)} == {a.name}
        assert "/kv_events" not in str([a.state()["paths"], b.state()["paths"]])
    finally:
        stop_router(router)


def test_sglang_without_metrics_is_routed_by_the_routers_own_count(tmp_path: Path, standins) -> None:  # noqa: ANN001
    a, b = standins("sglang", "--no-metrics"), standins("sglang", "--no-metrics")
    router = router_for(tmp_path, [a, b])
    try:
        wait_for(lambda: "GET /metrics answered 404" in router.log(), 10, "the missing metrics logged")
        assert [p["load"] for p in router.health()["pods"]] == [None, None]
        assert {chat(router) for _ in range(4)} == {a.name, b.name}  # ties go round-robin
        assert router.log().count("load unknown") == 2  # once per pod, not once per probe
    finally:
        stop_router(router)


@pytest.mark.parametrize("engine, down", [("vllm", "dead"), ("sglang", "starting")])
def test_health_follows_each_engines_endpoint(tmp_path: Path, standins, engine: str, down: str) -> None:  # noqa: ANN001
    a, b = standins(engine), standins(engine)
    router = router_for(tmp_path, [a, b], "--policy", "round-robin")
    try:
        b.set(**{down: True})  # the engine's /health answers 503
        wait_for(lambda: not router.pod(b.name)["ready"], 10, f"{b.name} not ready")
        assert {chat(router) for _ in range(4)} == {a.name}
        a.set(**{down: True})
        wait_for(lambda: router.request("GET", "/health").status == 503, 10, "no pod ready")
        a.set(**{down: False})
        b.set(**{down: False})
        wait_for(lambda: all(p["ready"] for p in router.health()["pods"]), 10, "both pods back")
        assert {chat(router) for _ in range(4)} == {a.name, b.name}
        health_path = "GET /health"
        assert a.state()["paths"][health_path] >= 3 and not any("kv_events" in p for p in a.state()["paths"])
    finally:
        stop_router(router)
