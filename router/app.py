"""The router's HTTP server: OpenAI routes proxied to a chosen pod, fleet-wide reset, health, metrics.

A generation request is read once (to tokenize it for the policy), then its raw body goes unchanged to
the chosen pod and the pod's reply comes back unchanged, streamed chunk by chunk for server-sent events.
A client that hangs up cancels its handler, which closes the upstream connection, so the pod aborts the
request within one engine step, as if the client had called the pod directly.

What comes back from a pod is bounded: a pod silent for `--proxy-timeout` gets the client a 504 (or, once
a stream has started, an error event that ends it), a non-streamed reply longer than `--max-reply-bytes`
a 502, and any failure after the request was sent stops routing to the pod until its next passing probe.
"""

from __future__ import annotations

import asyncio
import json
import logging
import signal
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from kvpilot.admin_token import authorized
from kvpilot.http_limits import UPSTREAM_IDLE_S, start_server
from kvpilot.protocol.errors import error_middleware
from kvpilot.protocol.fields import IGNORED_FIELDS_HEADER
from kvpilot.protocol.replies import json_response
from kvpilot.protocol.requests import ApiError, parse_reset_flag
from kvpilot.router.engines import PROBES, read_capped
from kvpilot.router.fleet_reset import reset_pods
from kvpilot.router.index import PrefixIndex
from kvpilot.router.kv_stream import PodEventStream
from kvpilot.router.metrics import RouterMetrics
from kvpilot.router.pods import Fleet, Pod
from kvpilot.router.policy import Decision, LeastLoad, PrefixAware, RoundRobin, hash_schemes
from kvpilot.router.prompts import PromptReader
from kvpilot.router.relay import relay_stream
from kvpilot.router.settings import RouterSettings
from kvpilot.router.version_choice import pinned_version
from kvpilot.router.weight_versions import describe

log = logging.getLogger(__name__)

FORWARD_REQUEST_HEADERS = ("Content-Type", "Accept", "Authorization")
FORWARD_RESPONSE_HEADERS = ("Content-Type", "Cache-Control", "X-Accel-Buffering", IGNORED_FIELDS_HEADER)
POD_HEADER = "X-Kvpilot-Pod"  # which pod served the request, for clients and tests
DP_RANK_HEADER = "X-data-parallel-rank"  # vLLM's: the rank of a data-parallel pod to run on
# The request never reached the pod (refused, or no connection within sock_connect): nothing ran there.
UNREACHED = (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError)
SSE_TAIL_BYTES = 16384  # of a stream, kept for its usage event (sent last)


@dataclass(slots=True)
class Router:
    settings: RouterSettings
    fleet: Fleet
    index: PrefixIndex
    policy: RoundRobin
    reader: PromptReader | None
    metrics: RouterMetrics
    session: aiohttp.ClientSession
    proxy_timeout: aiohttp.ClientTimeout = field(init=False)  # of every proxied request: made once

    def __post_init__(self) -> None:
        self.proxy_timeout = aiohttp.ClientTimeout(
            total=None, sock_connect=5, sock_read=self.settings.proxy_timeout_s
        )


ROUTER = web.AppKey("kvpilot_router", Router)


def make_policy(name: str, index: PrefixIndex) -> RoundRobin:
    if name == "prefix-aware":
        return PrefixAware(index)
    if name == "round-robin":
        return RoundRobin()
    if name == "least-load":
        return LeastLoad()
    raise ValueError(f"unknown policy {name!r}")


def create_app(router: Router) -> web.Application:
    limit = router.settings.max_body_bytes
    app = web.Application(client_max_size=limit, middlewares=[error_middleware(limit)])
    app[ROUTER] = router
    app.router.add_post("/v1/completions", generate)
    app.router.add_post("/v1/chat/completions", generate)
    app.router.add_get("/v1/models", models)
    app.router.add_post("/reset_prefix_cache", reset_prefix_cache)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    return app


def _no_pod() -> ApiError:
    return ApiError(503, "no pod of the fleet is ready", code="no_ready_pod")


# ---- OpenAI routes -------------------------------------------------------------------------------
async def generate(request: web.Request) -> web.StreamResponse:
    r = request.app[ROUTER]
    raw = await request.read()
    prompts = None
    if r.reader is not None and r.policy.needs_prompts and raw:
        prompts = await r.reader.prompts(request.path, raw, hash_schemes(r.fleet.ready_pods()))
    pinned = pinned_version(raw)
    tried: set[str] = set()
    while True:
        pods = [p for p in r.fleet.pods if p.ready and p.name not in tried]
        if not pods:
            raise _no_pod()
        pods = r.fleet.versions.eligible(pods, pinned)  # all of one weight version
        decision = r.policy.choose(pods, prompts)
        try:
            return await _proxy(request, r, decision, raw)
        except UNREACHED:
            # Never reached the pod, so nothing ran there: safe to send elsewhere.
            log.warning("%s is unreachable; trying another pod", decision.pod.name)
            r.fleet.mark_unready(decision.pod)
            tried.add(decision.pod.name)


async def _proxy(request: web.Request, r: Router, decision: Decision, raw: bytes) -> web.StreamResponse:
    pod = decision.pod
    m = r.metrics
    m.child(m.decisions, pod.name, r.policy.name, decision.reason).inc()
    in_headers = request.headers
    headers = {}
    for h in FORWARD_REQUEST_HEADERS:
        v = in_headers.get(h)
        if v is not None:
            headers[h] = v
    if decision.rank is not None:
        headers[DP_RANK_HEADER] = str(decision.rank)
        pod.rank_in_flight[decision.rank] = pod.rank_in_flight.get(decision.rank, 0) + 1
    in_flight = m.child(m.in_flight, pod.name)
    pod.in_flight += 1
    in_flight.set(pod.in_flight)
    status = 0
    # Usage is read (a JSON parse) only where it is compared with a prediction.
    wants_usage = decision.predicted_cached_tokens is not None
    try:
        async with r.session.post(
            pod.target(request.path_qs), data=raw, headers=headers, timeout=r.proxy_timeout
        ) as up:
            status = up.status
            up_headers = up.headers
            out_headers = {POD_HEADER: pod.name}
            for h in FORWARD_RESPONSE_HEADERS:
                v = up_headers.get(h)
                if v is not None:
                    out_headers[h] = v
            if decision.rank is not None:
                out_headers[DP_RANK_HEADER] = str(decision.rank)
            try:
                if up_headers.get("Content-Type", "").startswith("text/event-stream"):
                    return await _relay_stream(request, r, decision, up, out_headers, wants_usage)
                body = await read_capped(up, r.settings.max_reply_bytes)
                if body is None:
                    log.warning("%s sent a reply of more than %d bytes", pod.name, r.settings.max_reply_bytes)
                    raise ApiError(
                        502,
                        f"pod {pod.name} sent a reply of more than {r.settings.max_reply_bytes} bytes",
                        code="reply_too_large",
                    )
                if wants_usage:
                    _record_usage(r, decision, _json_usage(body))
                return web.Response(body=body, status=status, headers=out_headers)
            except BaseException:
                up.close()  # drop the connection: the pod sees the client leave and aborts
                raise
    except UNREACHED:
        raise
    except (aiohttp.ClientError, TimeoutError) as exc:
        raise _pod_failed(r, pod, exc) from None
    finally:
        pod.in_flight -= 1
        if decision.rank is not None:
            pod.rank_in_flight[decision.rank] -= 1
        in_flight.set(pod.in_flight)
        m.child(m.requests, pod.name, r.policy.name, str(status)).inc()


async def _relay_stream(
    request: web.Request,
    r: Router,
    decision: Decision,
    up: aiohttp.ClientResponse,
    out_headers: dict[str, str],
    wants_usage: bool,
) -> web.StreamResponse:
    """Relay a server-sent event stream: each piece read from the pod is one write to the client,
    untouched (router/relay.py). Only the last 16 KiB are kept, for the usage event sent last."""
    resp = web.StreamResponse(status=up.status, headers=out_headers)
    await resp.prepare(request)
    tail = b""
    try:
        tail = await relay_stream(up.content, request, resp, SSE_TAIL_BYTES if wants_usage else 0)
    except (aiohttp.ClientError, TimeoutError) as exc:
        # Headers are sent: end the stream with an error event.
        err = _pod_failed(r, decision.pod, exc)
        await resp.write(b"data: " + json.dumps(err.body()).encode() + b"\n\n")
    await resp.write_eof()
    if wants_usage:
        _record_usage(r, decision, _sse_usage(tail[-SSE_TAIL_BYTES:]))
    return resp


def _pod_failed(r: Router, pod: Pod, exc: BaseException) -> ApiError:
    """The client's error for a pod that failed after the request was sent: 504 if it went silent, else
    502. Either way the pod gets no more requests until its next passing probe."""
    r.fleet.mark_unready(pod)
    if isinstance(exc, TimeoutError):
        log.warning("%s sent nothing for %gs", pod.name, r.settings.proxy_timeout_s)
        return ApiError(
            504, f"pod {pod.name} sent nothing for {r.settings.proxy_timeout_s:g} s", code="upstream_timeout"
        )
    log.warning("%s failed mid-request: %s", pod.name, exc)
    return ApiError(502, f"pod {pod.name} failed: {type(exc).__name__}", code="bad_gateway")


def _record_usage(r: Router, decision: Decision, usage: dict | None) -> None:
    """Compare the predicted cached tokens with what the pod reported (when both are known)."""
    if decision.predicted_cached_tokens is None or not isinstance(usage, dict):
        return
    details = usage.get("prompt_tokens_details")
    reported = details.get("cached_tokens") if isinstance(details, dict) else None
    if type(reported) is not int or reported < 0:  # a counter only goes up
        return
    name = decision.pod.name
    r.metrics.predicted.labels(name).inc(decision.predicted_cached_tokens)
    r.metrics.reported.labels(name).inc(reported)
    if reported < decision.predicted_cached_tokens:
        r.metrics.stale.labels(name).inc()


def _json_usage(body: bytes) -> dict | None:
    try:
        doc = json.loads(body)
    except (ValueError, RecursionError):  # RecursionError: nested too deep
        return None
    return doc.get("usage") if isinstance(doc, dict) else None


def _sse_usage(tail: bytes) -> dict | None:
    """The usage chunk of a stream (sent last, when the client asked for stream_options.include_usage)."""
    for line in reversed(tail.split(b"\n")):
        if line.startswith(b"data: {") and b'"usage"' in line:
            try:
                usage = json.loads(line[6:]).get("usage")
            except (ValueError, RecursionError, AttributeError):
                return None
            return usage if isinstance(usage, dict) else None
    return None


async def models(request: web.Request) -> web.Response:
    r = request.app[ROUTER]
    for pod in r.fleet.ready_pods():
        try:
            async with r.session.get(pod.url + "/v1/models", timeout=aiohttp.ClientTimeout(total=10)) as up:
                return web.Response(body=await up.read(), status=up.status, content_type="application/json")
        except (TimeoutError, aiohttp.ClientError):
            r.fleet.mark_unready(pod)
    raise _no_pod()


# ---- operations ----------------------------------------------------------------------------------
async def reset_prefix_cache(request: web.Request) -> web.Response:
    r = request.app[ROUTER]
    if not authorized(request.headers.get("Authorization"), r.settings.admin_token):
        r.metrics.resets.labels("unauthorized").inc()
        raise ApiError(
            401, "a valid admin token is required: Authorization: Bearer <token>", code="invalid_admin_token"
        )
    raw = await request.read()
    body = None
    if raw.strip():
        try:
            body = json.loads(raw)
        except ValueError:
            raise ApiError(400, "the body must be JSON", code="invalid_json") from None
    flag = parse_reset_flag(
        request.query.get("reset_running_requests"), body if isinstance(body, dict) else None
    )
    pods = list(r.fleet.pods)
    if not pods:
        # Nothing was flushed: a 200 here would let a benchmark (AIPerf --reset-kv-cache) go on as if it
        # had. 503 is what such clients retry while a fleet scales up.
        r.metrics.resets.labels("no_pods").inc()
        raise ApiError(503, "the fleet has no pods to reset", code="no_pods")
    clears_before = {p.name: {h: r.index.clears(h) for h in p.holders()} for p in pods}
    loop = asyncio.get_running_loop()
    started = loop.time()
    results = await reset_pods(
        pods, r.settings.engine, r.settings.admin_token, flag, r.settings.reset_timeout_s
    )
    # The index must not route on pre-reset blocks once we answer: catch up with each reset pod's events
    # up to its AllBlocksCleared (its earlier events come before it, in order), or drop its entries
    # ourselves. One deadline for all of it, within the reset's own: a pod that trickles its replay
    # cannot hold the answer back.
    deadline = min(loop.time() + r.settings.clear_wait_s, started + r.settings.reset_timeout_s)
    by_name = {p.name: p for p in pods}
    reset = [res.pod for res in results if res.success]
    states = await asyncio.gather(
        *(_await_clear(r, by_name[name], clears_before[name], deadline) for name in reset)
    )
    index_state = dict(zip(reset, states))
    failed = [res.pod for res in results if not res.success]
    r.metrics.resets.labels("failed" if failed else "success").inc()
    pods_out = [{**res.to_dict(), "index": index_state.get(res.pod)} for res in results]
    body_out: dict[str, Any] = {"success": not failed, "pods": pods_out}
    if failed:
        log.warning("fleet reset failed on %s", ", ".join(failed))
        err = ApiError(
            502,
            f"the prefix cache reset failed on {len(failed)} of {len(results)} pods: " + ", ".join(failed),
            code="reset_failed",
        )
        body_out.update(err.body())
        return json_response(body_out, status=502)
    log.info("fleet reset: %d pods", len(results))
    return json_response(body_out)


async def _await_clear(r: Router, pod: Pod, before: dict[tuple[str, int], int], deadline: float) -> str:
    """Make the pod's entries (each rank's) reflect its reset before the router answers: "cleared" once
    each rank's AllBlocksCleared is applied by `deadline`, else "dropped" (the rank's entries are emptied
    and its events ignored until its clear arrives); "none" for a pod whose events are not followed."""
    if pod.kv_events != "on":
        for holder in pod.holders():
            r.index.clear(holder)  # nothing indexed from it; keep it that way
        return "none"
    cleared = await asyncio.gather(
        *(_rank_cleared(r, s, before.get(s.key, 0), deadline) for s in pod.streams)
    )
    for stream, ok in zip(pod.streams, cleared):
        if not ok:
            log.warning(
                "%s rank %d: its AllBlocksCleared was not applied within %.1fs of its reset; its entries "
                "are dropped and its events ignored until one arrives",
                pod.name,
                stream.rank,
                r.settings.clear_wait_s,
            )
            r.index.distrust(stream.key)
    return "cleared" if all(cleared) else "dropped"


async def _rank_cleared(r: Router, stream: PodEventStream, before: int, deadline: float) -> bool:
    # Each rank recorded AllBlocksCleared before the pod answered, and its publisher sends what it
    # recorded before serving a replay: one replay per rank now brings every batch up to the clear.
    holder = stream.key
    if r.index.clears(holder) > before:
        return True  # applied live already
    loop = asyncio.get_running_loop()
    try:
        async with asyncio.timeout_at(deadline):
            await stream.catch_up()
            if r.index.clears(holder) > before:
                return True
            return await r.index.wait_cleared(holder, before, max(0.0, deadline - loop.time()))
    except TimeoutError:
        return False


async def health(request: web.Request) -> web.Response:
    r = request.app[ROUTER]
    pods = [
        {
            "pod": p.name,
            "url": p.url,
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
    ok = any(p.ready for p in r.fleet.pods)
    body = {"status": "ok" if ok else "no_ready_pod", "engine": r.settings.engine, "policy": r.policy.name}
    return json_response({**body, "pods": pods}, status=200 if ok else 503)


async def metrics(request: web.Request) -> web.Response:
    r = request.app[ROUTER]
    for p in r.fleet.pods:
        r.metrics.indexed_blocks.labels(p.name).set(r.index.blocks_of(p.holders()))
    return web.Response(body=r.metrics.render(), headers={"Content-Type": CONTENT_TYPE_LATEST})


# ---- running -------------------------------------------------------------------------------------
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
    policy = make_policy(settings.policy, index)
    reader = await asyncio.to_thread(PromptReader, model) if policy.needs_prompts else None
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=5)
    # Idle pod connections are dropped before a pod's header timeout would close them under a request.
    connector = aiohttp.TCPConnector(keepalive_timeout=UPSTREAM_IDLE_S)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        fleet = Fleet(
            index,
            metrics_,
            session,
            probe=PROBES[settings.engine],
            kv_events_curve_dir=settings.kv_events_curve_dir,
        )
        router = Router(settings, fleet, index, policy, reader, metrics_, session)
        app = create_app(router)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        watch = None
        if fleet_name is not None:
            from kvpilot.router.discovery import EndpointSliceWatch

            watch = EndpointSliceWatch(fleet_name, namespace, fleet.update)
            watch.start()
        else:
            fleet.update(pods or [])
        served = await start_server(
            app, settings.host, settings.port, settings.limits, shutdown_timeout=settings.shutdown_timeout_s
        )
        where = (
            f"the endpoints of {namespace}/{fleet_name}"
            if fleet_name
            else ", ".join(p.name for p in pods or [])
        )
        log.info(
            "routing %s (%s pods) on http://%s:%d to %s",
            settings.policy,
            settings.engine,
            settings.host,
            settings.port,
            where,
        )
        await stop.wait()
        log.info("shutting down")
        if watch is not None:
            watch.stop()
        await served.cleanup()
        await fleet.stop()
        if reader is not None:
            reader.close()
    return 0
