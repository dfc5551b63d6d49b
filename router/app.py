"""The router's HTTP server: the app and its routes (OpenAI routes in proxy.py, the fleet-wide reset in
reset_api.py, health and metrics here), and `serve`, which wires the fleet, its index, the policy and the
prompt reader together and runs until SIGTERM."""

from __future__ import annotations

import asyncio
import gc
import logging
import signal
from typing import cast

import aiohttp
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from kvpilot.engines import traits_of
from kvpilot.kv.block_keys import key_scheme
from kvpilot.protocol.errors import error_middleware
from kvpilot.protocol.replies import json_response
from kvpilot.router import disaggregation
from kvpilot.router.app_state import ROUTER, Router
from kvpilot.router.fleet.pods import PREFILL, Fleet, Pod, parse_static_sources
from kvpilot.router.kv.index import PrefixIndex
from kvpilot.router.kv.weight_versions import describe
from kvpilot.router.metrics import RouterMetrics
from kvpilot.router.proxy import generate, models
from kvpilot.router.reset_api import reset_prefix_cache
from kvpilot.router.routing.policy import make_policy
from kvpilot.router.routing.prompts import PromptReader
from kvpilot.router.settings import RouterSettings
from kvpilot.serving.http_limits import UPSTREAM_IDLE_S, start_server

log = logging.getLogger(__name__)

# How long a starting router waits for its pods' first probes (each bounded at 5 s) before it listens.
FIRST_PROBE_WAIT_S = 10.0


def create_app(router: Router) -> web.Application:
    limit = router.settings.max_body_bytes
    app = web.Application(client_max_size=limit, middlewares=[error_middleware(limit)])
    app[ROUTER] = router
    app.router.add_post("/v1/completions", generate_any)
    app.router.add_post("/v1/chat/completions", generate_any)
    app.router.add_get("/v1/models", models)
    app.router.add_post("/reset_prefix_cache", reset_prefix_cache)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    return app


async def generate_any(request: web.Request) -> web.StreamResponse:
    """A generation request as the fleet's pods run it now: on two pods, prefill then decode, while they have
    roles (--prefill/--decode, or a disaggregated InferenceDeployment's pods under --fleet), else on one.
    Asked per request, so a --fleet router follows its fleet between the two shapes without a restart."""
    if request.app[ROUTER].fleet.disaggregated:
        return await disaggregation.generate(request)
    return await generate(request)


async def health(request: web.Request) -> web.Response:
    r = request.app[ROUTER]
    pods = [
        {
            "pod": p.name,
            "url": p.url,
            "role": p.role,
            "ready": p.ready,
            "in_flight": p.in_flight,
            "load": p.engine_load,
            "kv_events": p.kv_events,
            "synced": p.synced(),
            "indexed_blocks": r.index.blocks_of(p.holders()),
            "ranks": p.num_ranks,
            # each followed rank's; without KV events, what its /health names
            "weight_versions": [describe(v) for v in p.versions() or [p.weight_version]],
        }
        for p in r.fleet.pods
    ]
    # A disaggregated fleet serves while a decode pod is ready (without a prefill pod it computes prompts).
    ok = any(p.ready and p.role != PREFILL for p in r.fleet.pods)
    body = {"status": "ok" if ok else "no_ready_pod", "engine": r.settings.engine, "policy": r.policy.name}
    return json_response({**body, "pods": pods}, status=200 if ok else 503)


async def metrics(request: web.Request) -> web.Response:
    r = request.app[ROUTER]
    for p in r.fleet.pods:
        r.metrics.indexed_blocks.labels(p.name).set(r.index.blocks_of(p.holders()))
    return web.Response(body=r.metrics.render(), headers={"Content-Type": CONTENT_TYPE_LATEST})


async def serve(
    settings: RouterSettings,
    model: str | None,
    pods: list[Pod] | None = None,
    fleet_name: str | None = None,
    namespace: str = "default",
) -> int:
    """Serve until SIGTERM/SIGINT; the pods are `pods` (static) or the Service `fleet_name`'s endpoints."""
    index = PrefixIndex()
    metrics_ = RouterMetrics()
    policy = make_policy(cast(str, settings.policy), index)  # set by RouterSettings.__post_init__
    decode_policy = make_policy(policy.name, index)
    reader = await asyncio.to_thread(PromptReader, model) if policy.needs_prompts else None
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=5)
    # Idle pod connections are dropped before a pod's header timeout would close them under a request.
    connector = aiohttp.TCPConnector(keepalive_timeout=UPSTREAM_IDLE_S)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        fleet = Fleet(
            index,
            metrics_,
            session,
            engine=traits_of(settings.engine),
            kv_events_curve_dir=settings.kv_events_curve_dir,
            vllm_events=(
                settings.kv_events_block_size,
                key_scheme(settings.kv_events_hash_algo, settings.kv_events_hash_seed),
            ),
            static_sources=parse_static_sources(settings.kv_event_source or []),
        )
        router = Router(settings, fleet, index, policy, reader, metrics_, session, decode_policy)
        app = create_app(router)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        watch = None
        if fleet_name is not None:
            from kvpilot.router.fleet.discovery import EndpointSliceWatch

            watch = EndpointSliceWatch(fleet_name, namespace, fleet.update)
            watch.start()
        else:
            fleet.update(pods or [])
        await fleet.first_probes(FIRST_PROBE_WAIT_S)
        served = await start_server(
            app, settings.host, settings.port, settings.limits, shutdown_timeout=settings.shutdown_timeout_s
        )
        picker = None
        if settings.endpoint_picker_port is not None:
            from kvpilot.router import endpoint_picker  # grpc and Envoy's messages: only when asked for

            picker = await endpoint_picker.start(router, settings.host, settings.endpoint_picker_port)
            log.info(
                "endpoint picker (Envoy ext_proc) on %s:%d", settings.host, settings.endpoint_picker_port
            )
        where = (
            f"the endpoints of {namespace}/{fleet_name}"
            if fleet_name
            else ", ".join(p.described() for p in pods or [])
        )
        log.info(
            "routing %s (%s pods) on http://%s:%d to %s",
            settings.policy,
            settings.engine,
            settings.host,
            settings.port,
            where,
        )
        # What start-up built (transformers and the tokenizer: ~350,000 objects with the prompt reader) lives
        # as long as the router: out of the collector's sight, a full collection costs ~2 ms, not ~170 ms of
        # CPU and of the event loop's time (once in a few thousand requests; ~0.05 ms a request averaged).
        gc.freeze()
        await stop.wait()
        log.info("shutting down")
        if watch is not None:
            watch.stop()
        if picker is not None:
            # Streams open are requests in flight through the gateway: they get the same grace.
            await picker.stop(settings.shutdown_timeout_s)
        await served.cleanup()
        router.pool.close()
        await fleet.stop()
        if reader is not None:
            reader.close()
    return 0
