"""The daemon's HTTP server: app factory, error middleware, operations routes, and the serve loop.

`create_app(engine, settings)` builds the aiohttp application around an `EngineClient` (from
`start_engine`, `daemon/engine/client.py`); `serve(engine, settings)` runs it until SIGTERM/SIGINT and
drains. The server knows the engine only through that client and its `EngineInfo`.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import signal
import sys
from pathlib import Path
from typing import Any, cast

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from kvpilot import __version__
from kvpilot.daemon.engine.client import EngineClient, EngineDeadError
from kvpilot.daemon.engine.outputs import CacheStats
from kvpilot.daemon.kv_transfer.pull import REASONS as PULL_FAILURES
from kvpilot.daemon.kv_transfer.remote import LANDING_REFUSALS
from kvpilot.daemon.kv_transfer.server import TransferServer
from kvpilot.daemon.server import http_log
from kvpilot.daemon.server.app_state import STATE, ServerState, running_engine
from kvpilot.daemon.server.choices import TokenTexts
from kvpilot.daemon.server.disagg import PLAN_REFUSALS, transfer_key
from kvpilot.daemon.server.metrics import DaemonMetrics, cache_config_labels
from kvpilot.daemon.server.openai_api import chat_completions, completions, tokenize
from kvpilot.daemon.server.prepare import PromptRules
from kvpilot.daemon.server.settings import ServerSettings
from kvpilot.daemon.server.weights.lora_routes import ROUTES as LORA_ROUTES
from kvpilot.daemon.server.weights.routes import ROUTES as WEIGHT_ROUTES
from kvpilot.protocol import JSONObject
from kvpilot.protocol.errors import ApiError, Handler, error_middleware, error_response, unavailable
from kvpilot.protocol.replies import json_response
from kvpilot.protocol.requests import parse_json_object, parse_reset_flag, parse_reset_scope
from kvpilot.protocol.schema import openapi
from kvpilot.serving.admin_token import authorized
from kvpilot.serving.http_limits import start_server
from kvpilot.serving.text_pool import Busy, TextPool

log = logging.getLogger(__name__)

TRANSFER_FAILURES = (*PULL_FAILURES, *LANDING_REFUSALS, *PLAN_REFUSALS)

__all__ = ["ServerSettings", "create_app", "serve"]

GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions")


# ---- app -----------------------------------------------------------------------------------------
def create_app(engine: EngineClient, settings: ServerSettings | None = None) -> web.Application:
    settings = settings or ServerSettings()
    served = list(settings.served_model_names) or [engine.info.model_name]
    if clash := set(served) & set(engine.info.lora_adapters):
        raise ValueError(f"--lora-modules names {', '.join(sorted(clash))}: the base model's name")
    connector = engine.kv_connector
    state = ServerState(
        engine,
        settings,
        served,
        metrics=DaemonMetrics(
            lambda: _rank_snapshots(engine),
            served[0],
            engine.info.weight_version,
            cache_config_labels(engine.info),
            TRANSFER_FAILURES if connector is not None else (),
        ),
        text=TextPool(settings.text_workers, settings.max_pending_prepare),
        rules=PromptRules.of(engine.info, served),
        token_texts=TokenTexts(engine.info.tokenizer),
        adapters=dict(engine.info.lora_adapters),
    )
    state.idle.set()
    state.weights.version = engine.info.weight_version
    if connector is not None and state.metrics.transfer is not None:
        connector.remote.on_refused = state.metrics.transfer.failed
        state.transfer_key = transfer_key(settings.admin_token)
    app = web.Application(
        client_max_size=settings.max_body_bytes,
        middlewares=[error_middleware(settings.max_body_bytes), _track_requests],
    )
    app[STATE] = state
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/reset_prefix_cache", reset_prefix_cache)
    # SGLang's name for the same reset (its server takes GET and POST): sglang-router's /flush_cache
    # sends it to every worker.
    app.router.add_route("GET", "/flush_cache", reset_prefix_cache)
    app.router.add_post("/flush_cache", reset_prefix_cache)
    app.router.add_get("/prefix_cache", prefix_cache)
    app.router.add_post("/unpin_all_pinned_prefixes", unpin_all_pinned_prefixes)
    app.router.add_get("/openapi.json", openapi_schema)
    app.router.add_get("/kv_events", kv_events)
    for method, path, handler in WEIGHT_ROUTES + LORA_ROUTES:
        app.router.add_route(method, path, handler)
    app.on_startup.append(_start_engine)
    app.on_cleanup.append(_stop_engine)
    return app


async def _start_engine(app: web.Application) -> None:
    state = app[STATE]
    state.engine.start()
    connector = state.engine.kv_connector
    if connector is not None and connector.held is not None and state.metrics.transfer is not None:
        cfg = connector.config
        state.transfer_server = TransferServer(
            connector.held, cfg.host, cfg.port, cfg.pull_timeout_s, state.metrics.transfer.sent
        )
        connector.port = await state.transfer_server.start()


async def _stop_engine(app: web.Application) -> None:
    state = app[STATE]
    if state.transfer_server is not None:
        await state.transfer_server.stop()
    await state.engine.stop()
    state.text.shutdown()


@web.middleware
async def _track_requests(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Count requests in flight for the drain, refuse generations while draining, and word the engine's
    failures as OpenAI errors (error_middleware, outside this one, answers them)."""
    state = request.app[STATE]
    if request.path in GENERATION_PATHS and state.draining:
        raise ApiError(503, "the server is shutting down", code="shutting_down")
    state.in_flight += 1
    state.idle.clear()
    try:
        return await handler(request)
    except Busy as exc:
        raise unavailable(str(exc), "queue_full") from None
    except EngineDeadError:
        raise ApiError(503, "the engine is not running", code="engine_unavailable") from None
    finally:
        state.in_flight -= 1
        if state.in_flight == 0:
            state.idle.set()


def _rank_snapshots(engine: EngineClient) -> list[tuple[str | None, CacheStats]]:
    """Each rank's latest published stats for the metrics, labelled by rank when there are several."""
    states = engine.rank_states()
    multi = len(states) > 1
    return [(str(r) if multi else None, s.stats) for r, s in enumerate(states) if s.stats is not None]


# ---- operations ----------------------------------------------------------------------------------
async def health(request: web.Request) -> web.Response:
    state = request.app[STATE]
    if state.draining:
        return json_response({"status": "draining"}, status=503)
    if not state.engine.alive:
        reason = state.engine.error or "starting"
        return json_response({"status": "unhealthy", "reason": reason}, status=503)
    w = state.weights
    body: dict[str, Any] = {
        "status": "ok",
        "weight_version": w.version,
        "digest": w.digest,
        "paused": w.paused,
    }
    if state.engine.info.enable_lora:
        # Each adapter's identity, as its blocks' keys carry it: a router keys an adapter's prompts so.
        body["lora_adapters"] = {name: a.digest for name, a in state.adapters.items()}
    return json_response(body)


async def metrics(request: web.Request) -> web.Response:
    body = request.app[STATE].metrics.render()
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


async def models(request: web.Request) -> web.Response:
    state = request.app[STATE]

    def entry(name: str, root: str, parent: str | None) -> JSONObject:
        return {
            "id": name,
            "object": "model",
            "created": state.created,
            "owned_by": "kvpilot",
            "root": root,
            "parent": parent,
            "max_model_len": state.engine.info.max_model_len,
            "weight_version": state.weights.version,
        }

    base = state.served[0]
    # Adapters as vLLM lists them: the adapter's path as its root, the base model as its parent. The path
    # is the host's filesystem, which only the admin (the operator's adapter updates read it) may see;
    # anyone else reads the adapter's name there.
    admin = authorized(request.headers.get("Authorization"), state.settings.admin_token)
    data = [entry(name, base, None) for name in state.served]
    data += [entry(name, adapter.path if admin else name, base) for name, adapter in state.adapters.items()]
    return json_response({"object": "list", "data": data})


async def openapi_schema(request: web.Request) -> web.Response:
    return json_response(openapi(__version__))


async def prefix_cache(request: web.Request) -> web.Response:
    engine = running_engine(request.app[STATE])
    ranks = await engine.rank_stats()
    body = CacheStats.total(ranks).to_dict()
    body["enable_prefix_caching"] = engine.info.enable_prefix_caching
    body["engine_steps"] = sum(s.steps for s in engine.rank_states())
    body["ranks"] = [{"rank": r, **s.to_dict()} for r, s in enumerate(ranks)]
    body["weight_version"] = request.app[STATE].weights.version
    if (connector := engine.kv_connector) is not None:
        body["kv_transfer"] = connector.describe()
        if (server := request.app[STATE].transfer_server) is not None:
            body["kv_transfer"]["sending"] = server.sending
    return json_response(body)


async def kv_events(request: web.Request) -> web.Response:
    """Where this daemon publishes its KV events, so a router needs only its HTTP address."""
    where = request.app[STATE].engine.describe_kv_events(request.url.host)
    if where is None:
        raise ApiError(
            404, "KV events are off (start the daemon with --kv-events-endpoint)", code="not_found"
        )
    return json_response(where)


def _admin_only(request: web.Request) -> None:
    if not authorized(request.headers.get("Authorization"), request.app[STATE].settings.admin_token):
        raise ApiError(
            401, "a valid admin token is required: Authorization: Bearer <token>", code="invalid_admin_token"
        )


async def unpin_all_pinned_prefixes(request: web.Request) -> web.Response:
    """vLLM PR 27046's route: every pinned block let go (or, with a scoped reset's parameters, those of one
    adapter, salt, weight version or tenant), on every rank. The blocks stay cached, evicted in turn."""
    state = request.app[STATE]
    _admin_only(request)
    raw = await request.read()
    scope = parse_reset_scope(request.query, parse_json_object(raw) if raw.strip() else None)
    try:
        ranks = await state.engine.unpin_ranks(state.settings.reset_timeout, scope)
    except EngineDeadError:
        raise ApiError(503, "the engine is not running", code="engine_unavailable") from None
    failed = [r for r in ranks if r.error is not None]
    if failed:
        names = ", ".join(f"{r.rank} ({r.error})" for r in failed)
        err = ApiError(500, f"unpinning failed on rank {names}", code="unpin_failed")
        return error_response(err, {"success": False})
    unpinned = sum(int(cast(JSONObject, r.value)["unpinned_blocks"]) for r in ranks)
    log.info(
        "unpinned %d blocks%s on %d rank(s)",
        unpinned,
        "" if scope is None else f" of {scope.to_dict()}",
        len(ranks),
    )
    return json_response(
        {
            "success": True,
            "scope": None if scope is None else scope.to_dict(),
            "unpinned_blocks": unpinned,
            "ranks": [{"rank": r.rank, **cast(JSONObject, r.value)} for r in ranks],
        }
    )


async def reset_prefix_cache(request: web.Request) -> web.Response:
    state = request.app[STATE]
    m = state.metrics.resets
    try:
        _admin_only(request)
    except ApiError:
        m.labels("unauthorized").inc()
        raise
    raw = await request.read()
    body = parse_json_object(raw) if raw.strip() else None
    flag = parse_reset_flag("reset_running_requests", request.query.get("reset_running_requests"), body)
    # vLLM's reset_external=false leaves its offload tiers serving blocks from before the reset (vLLM
    # 57727); kvpilot's reset always covers every tier, so it refuses to be asked for less.
    if not parse_reset_flag("reset_external", request.query.get("reset_external"), body, default=True):
        raise ApiError(
            400,
            "reset_external=false is not supported: a kvpilot reset always clears every KV tier (pool, host "
            "memory, disk), so nothing from before it can be served",
            param="reset_external",
            code="unsupported",
        )
    scope = parse_reset_scope(request.query, body)
    try:
        ranks = await state.engine.reset_ranks(flag, state.settings.reset_timeout, scope)
    except EngineDeadError:
        m.labels("unavailable").inc()
        raise ApiError(503, "the engine is not running", code="engine_unavailable") from None
    entries = [r.to_dict() for r in ranks]
    failed = [r for r in ranks if not r.success]
    if failed:
        m.labels("failed").inc()
        names = ", ".join(f"{r.rank} ({r.error})" for r in failed)
        log.error("prefix cache reset failed on rank %s", names)
        err = ApiError(500, f"the prefix cache reset failed on rank {names}", code="reset_failed")
        return error_response(err, {"success": False, "ranks": entries})
    m.labels("success").inc()
    result = {
        "success": True,
        "scope": None if scope is None else scope.to_dict(),  # None: everything
        "epoch": min(r.epoch for r in ranks),
        "evicted_blocks": sum(r.evicted_blocks for r in ranks),
        "in_flight_requests": sum(r.in_flight_requests for r in ranks),
        "preempted_requests": sum(r.preempted_requests for r in ranks),
        "duration_ms": max(r.duration_ms for r in ranks),
        "evicted_by_tier": {
            t: sum(r.evicted_by_tier.get(t, 0) for r in ranks) for t in ranks[0].evicted_by_tier
        },
        "unpinned_blocks": sum(r.unpinned_blocks for r in ranks),
        "ranks": entries,
    }
    if dropped := [r.dropped_holds for r in ranks if r.dropped_holds is not None]:
        result["dropped_holds"] = sum(dropped)  # prefills held for remote decodes (docs/disaggregation.md)
    log.info(
        "prefix cache reset%s on %d rank(s): epoch %d, %d blocks evicted, %d in flight, %d preempted, %.2f ms",
        "" if scope is None else f" of {scope.to_dict()}",
        len(ranks),
        result["epoch"],
        result["evicted_blocks"],
        result["in_flight_requests"],
        result["preempted_requests"],
        result["duration_ms"],
    )
    return json_response(result)


# ---- running -------------------------------------------------------------------------------------
def _cli_command() -> str:
    """How a user here types this install's `kvpilot`: `kvpilot` where it is the one on PATH (the image),
    else its path next to this Python, relative to the working folder when under it (`.venv/bin/kvpilot` in a
    checkout)."""
    cli = Path(sys.executable).parent / "kvpilot"
    on_path = shutil.which("kvpilot")
    if on_path and Path(on_path).resolve() == cli.resolve():
        return "kvpilot"
    try:
        return str(cli.absolute().relative_to(Path.cwd()))
    except ValueError:
        return str(cli)


def _local_url(host: str, port: int) -> str:
    """The URL to type on this machine: a wildcard listen address is reached as localhost."""
    if host in ("", "0.0.0.0", "::"):
        host = "localhost"
    elif ":" in host:
        host = f"[{host}]"
    return f"http://{host}:{port}"


async def serve(engine: EngineClient, settings: ServerSettings) -> int:
    """Serve until SIGTERM or SIGINT, then drain: stop accepting, let in-flight requests finish within
    `shutdown_timeout`, stop the engine, return 0."""
    app = create_app(engine, settings)
    http_log.install()
    state = app[STATE]
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):  # before listening: no window where a signal is lost
        loop.add_signal_handler(sig, stop.set)
    # A client that disconnects cancels its handler at once, whose `finally` aborts the engine request,
    # so its blocks are freed before the next step.
    served = await start_server(app, settings.host, settings.port, settings.limits)
    tenants = settings.tenant_tokens
    log.info(
        "serving %s on http://%s:%d (admin token %s, %s, max body %d bytes)",
        ", ".join(state.served),
        settings.host,
        settings.port,
        "required" if settings.admin_token else "off",
        f"{len(set(tenants.values()))} tenants, each salted by the server" if tenants else "no tenants",
        settings.max_body_bytes,
    )
    # The line a newcomer waits for (README.md, "Try it"): where to point curl, and that it goes in another shell.
    url = _local_url(settings.host, served.port)
    log.info(
        "ready: in another shell, try `curl -s %s/v1/models` or `%s bench --url %s`", url, _cli_command(), url
    )
    await stop.wait()
    log.info(
        "shutting down: no new requests; draining %d in flight (up to %.0f s)",
        state.in_flight,
        settings.shutdown_timeout,
    )
    state.draining = True
    served.stop_listening()  # open connections finish their current request
    try:
        await asyncio.wait_for(state.idle.wait(), settings.shutdown_timeout)
    except TimeoutError:
        log.warning("grace period over with %d requests in flight; aborting them", state.in_flight)
    await served.cleanup()
    log.info("stopped")
    return 0
