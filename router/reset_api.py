"""`POST /reset_prefix_cache` on the router: every pod of the fleet reset through the shared fan-out
(fleet/reset.py) and, unless asked `verify=false`, proven cold by its canary; then the prefix index caught
up with each reset pod's AllBlocksCleared before the answer, so no request is routed on a block cached
before the reset once the caller hears it succeeded. A scoped reset (`lora_name`, `cache_salt`,
`weight_version`: kvpilot pods only) is caught up the same way with the BlockRemoved events that name the
scope's blocks, and the rest of the index stays."""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

from aiohttp import web

from kvpilot.protocol.errors import ApiError
from kvpilot.protocol.replies import json_response
from kvpilot.protocol.requests import parse_reset_flag, parse_reset_scope
from kvpilot.router.app_state import ROUTER, Router
from kvpilot.router.fleet.pods import Pod
from kvpilot.router.fleet.reset import reset_pods
from kvpilot.router.kv.stream import PodEventStream
from kvpilot.serving.admin_token import authorized

log = logging.getLogger(__name__)


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
    fields = body if isinstance(body, dict) else None
    # reset_external and verify default to true: a reset that leaves a tier warm, or that nobody checked,
    # is what a benchmark must not start on (docs/router.md).
    flags = {
        name: parse_reset_flag(name, request.query.get(name), fields, default)
        for name, default in (("reset_running_requests", False), ("reset_external", True), ("verify", True))
    }
    scope = parse_reset_scope(request.query, fields)
    if scope is not None and r.settings.engine != "kvpilot":
        raise ApiError(
            400,
            f"a scoped reset ({', '.join(scope.to_dict())}) needs kvpilot pods: {r.settings.engine} resets "
            "its whole cache only",
            param=next(iter(scope.to_dict())),
            code="unsupported",
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
        pods, r.settings.engine, r.settings.admin_token, r.settings.reset_timeout_s, scope=scope, **flags
    )
    # The index must not route on pre-reset blocks once we answer: catch up with each reset pod's events
    # up to its AllBlocksCleared (its earlier events come before it, in order), or drop its entries
    # ourselves. One deadline for all of it, within the reset's own: a pod that trickles its replay
    # cannot hold the answer back.
    deadline = min(loop.time() + r.settings.clear_wait_s, started + r.settings.reset_timeout_s)
    by_name = {p.name: p for p in pods}
    reset = [res.pod for res in results if res.success]
    catch_up = _await_clear if scope is None else _await_removed
    states = await asyncio.gather(
        *(catch_up(r, by_name[name], clears_before[name], deadline) for name in reset)
    )
    index_state = dict(zip(reset, states))
    failed = [res.pod for res in results if not res.success]
    r.metrics.resets.labels("failed" if failed else "success").inc()
    pods_out = [
        {**res.to_dict(), "role": by_name[res.pod].role, "index": index_state.get(res.pod)} for res in results
    ]
    body_out: dict[str, Any] = {
        "success": not failed,
        "scope": None if scope is None else scope.to_dict(),
        "pods": pods_out,
    }
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


async def _await_removed(r: Router, pod: Pod, before: object, deadline: float) -> str:
    """After a scoped reset: each rank's events up to its reset applied by `deadline` (one replay, as for a
    full reset: its BlockRemoved events name the scope's blocks), "removed"; a rank that does not catch up
    in time has its entries emptied, to be refilled by its next events ("dropped"); "none" for a pod
    whose events are not followed."""
    if pod.kv_events != "on":
        return "none"
    caught_up = await asyncio.gather(*(_caught_up(s, deadline) for s in pod.streams))
    for stream, ok in zip(pod.streams, caught_up):
        if not ok:
            log.warning(
                "%s rank %d: not caught up after its scoped reset; its entries are dropped",
                pod.name,
                stream.rank,
            )
            r.index.clear(stream.key)
    return "removed" if all(caught_up) else "dropped"


async def _caught_up(stream: PodEventStream, deadline: float) -> bool:
    try:
        async with asyncio.timeout_at(deadline):
            return await stream.catch_up()
    except TimeoutError:
        return False


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
