"""The weight update routes: vLLM's RL control plane and SGLang's `/update_weights_from_disk`.

Paths, bodies, query parameters and replies follow vLLM's `vllm/entrypoints/rl/online/api_router.py`
(vllm-project/vllm at 39929f1813ac) and the requests its `HTTPVLLMWeightSyncClient` sends, so trainers
written for vLLM drive this daemon unchanged; replies carry kvpilot's extras beside vLLM's keys (`ranks`,
`weight_version`, `digest`). Every route needs the admin token.

A trainer's loop: `/pause` -> `/start_weight_update` -> `/update_weights` (one or more) ->
`/finish_weight_update` -> `/resume`. The engine side (stage, swap, cache generation) is
`daemon/engine/weights/control.py`, the pause modes `engine.py`'s; this module checks the order on every rank
and answers honestly: never 200 unless every rank did it. `finish` is a two-phase commit over the
ranks: every rank must hold a stage of the same digest before any swaps, and if a rank fails its swap
after another succeeded, the daemon stops serving (unhealthy) rather than serve mixed weights. The
engine names what went wrong (`WeightErrorKind`); `HTTP_STATUS` here is the one place that says which
status each kind answers with.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from kvpilot.daemon.engine.client import EngineDeadError
from kvpilot.daemon.engine.weights.ops import (
    MIXED_VERSION,
    RESERVED_VERSIONS,
    PauseMode,
    RankReply,
    WeightErrorKind,
)
from kvpilot.daemon.server.app_state import STATE, ServerState
from kvpilot.protocol import JSONObject
from kvpilot.protocol.errors import ApiError
from kvpilot.protocol.replies import json_response
from kvpilot.protocol.requests import parse_json_object
from kvpilot.serving.admin_token import authorized

log = logging.getLogger(__name__)

# A weight route's own work: the request, its JSON body ({} without one) -> the reply's JSON.
Handler = Callable[[web.Request, ServerState, JSONObject], Awaitable[JSONObject]]
# What `route` makes of one: aiohttp's handler, with the admin check and the failure reply around it.
RouteHandler = Callable[[web.Request], Awaitable[web.Response]]
HTTP_STATUS = {
    WeightErrorKind.INCOMPATIBLE: 400,
    WeightErrorKind.NOT_FOUND: 404,
    WeightErrorKind.OUT_OF_ORDER: 409,
    WeightErrorKind.NO_MEMORY: 507,
    WeightErrorKind.TRANSFER_FAILED: 500,
    WeightErrorKind.RANK_FAILED: 500,
    WeightErrorKind.TIMEOUT: 500,
}
# The client's own verdicts on a rank that did not answer: they name no tensor.
NO_ANSWER = frozenset({WeightErrorKind.RANK_FAILED, WeightErrorKind.TIMEOUT})
CODES = {400: "incompatible_weights", 404: "no_checkpoint", 409: "out_of_order", 507: "no_staging_memory"}


class WeightFailure(Exception):
    """A weight operation that did not happen everywhere: the status, and every rank's reply."""

    def __init__(
        self, status: int, message: str, ranks: list[JSONObject] | None = None, tensor: str | None = None
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.ranks, self.tensor = status, message, ranks or [], tensor
        self.code: str | None = None  # the reply's error code when not the status's (CODES)

    def response(self, sglang: bool) -> web.Response:
        code = self.code or CODES.get(self.status, "weight_update_failed")
        body: dict[str, Any] = ApiError(
            self.status, self.message, "tensor" if self.tensor else None, code=code
        ).body()
        body.update(ranks=self.ranks, tensor=self.tensor)
        if sglang:
            body.update(success=False, message=self.message)
        return json_response(body, status=self.status)


def route(handler: Handler, sglang: bool = False) -> RouteHandler:
    """The admin check, the body, and the failure reply around one weight route."""

    async def wrapped(request: web.Request) -> web.Response:
        state = request.app[STATE]
        metrics = state.metrics.weights
        if not authorized(request.headers.get("Authorization"), state.settings.admin_token):
            metrics.updates.labels("unauthorized").inc()
            raise ApiError(
                401,
                "a valid admin token is required: Authorization: Bearer <token>",
                code="invalid_admin_token",
            )
        raw = await request.read() if request.method == "POST" else b""
        body = parse_json_object(raw) if raw.strip() else {}
        try:
            return json_response(await handler(request, state, body))
        except WeightFailure as fail:
            metrics.updates.labels("failed" if fail.status >= 500 else "refused").inc()
            log.warning("%s %s: %s", request.method, request.path, fail.message)
            return fail.response(sglang)
        except EngineDeadError:
            metrics.updates.labels("failed").inc()
            return WeightFailure(503, "the engine is not running").response(sglang)

    return wrapped


def rank_entry(reply: RankReply) -> JSONObject:
    """One rank's reply as the routes report it in `ranks`: its fields, or its error and status."""
    err = reply.error
    if err is None:
        return {"rank": reply.rank, **(reply.value or {})}
    entry: JSONObject = {"rank": reply.rank, "error": str(err), "status": HTTP_STATUS[err.kind]}
    if err.kind not in NO_ANSWER:
        entry["tensor"] = err.tensor
    return entry


def no_answer(entry: JSONObject) -> bool:
    """Whether a rank's entry (`rank_entry`) says it did not answer (timed out, died): it may have done the
    operation, or may yet."""
    return "error" in entry and "tensor" not in entry


async def call(
    state: ServerState, operation: Awaitable[list[RankReply]], phase: str | None = None
) -> list[JSONObject]:
    """An engine client's weight operation (not started yet), run on every rank; WeightFailure unless
    every rank succeeded."""
    start = time.monotonic()
    ranks = [rank_entry(r) for r in await operation]
    if phase is not None:
        state.metrics.weights.duration.labels(phase).observe(time.monotonic() - start)
    failed = [r for r in ranks if "error" in r]
    if failed:
        statuses = {r.get("status", 500) for r in failed}
        status = statuses.pop() if len(statuses) == 1 else 500
        if len(failed) < len(ranks) and status < 500:
            status = 500  # some ranks did it and some refused: not a caller's mistake any more
        named = "; ".join(f"rank {r['rank']}: {r['error']}" for r in failed)
        raise WeightFailure(status, named, ranks, failed[0].get("tensor"))
    return ranks


# ---- vLLM's routes --------------------------------------------------------------------------------
async def pause(request: web.Request, state: ServerState, body: JSONObject) -> JSONObject:
    mode = request.query.get("mode", "abort")  # clear_cache, deprecated in vLLM, is accepted and ignored
    await pause_mode(state, mode)
    return {"status": "paused", "mode": mode}


async def resume(request: web.Request, state: ServerState, body: JSONObject) -> JSONObject:
    await call(state, state.engine.resume_generation(rank_timeout(state)), "resume")
    state.weights.paused = None
    state.metrics.weights.paused.set(0)
    return {"status": "resumed"}


async def is_paused(request: web.Request, state: ServerState, body: JSONObject) -> JSONObject:
    ranks = await call(state, state.engine.is_paused(rank_timeout(state)))
    return {"is_paused": any(r["is_paused"] for r in ranks), "mode": ranks[0]["mode"], "ranks": ranks}


async def abort_requests(request: web.Request, state: ServerState, body: JSONObject) -> JSONObject:
    ids = body.get("request_ids") or []
    if not isinstance(ids, list) or not all(isinstance(i, str) for i in ids):
        raise ApiError(400, "request_ids must be a list of strings", "request_ids")
    ranks = await call(state, state.engine.abort_requests(tuple(ids), rank_timeout(state)))
    return {"status": "aborted", "aborted": sum(r["aborted"] for r in ranks)}


async def init_transfer(request: web.Request, state: ServerState, body: JSONObject) -> JSONObject:
    init_info = body.get("init_info", {})
    if not isinstance(init_info, dict):
        raise ApiError(400, "init_info must be an object", "init_info")
    ranks = await call(state, state.engine.init_weight_transfer(init_info, rank_timeout(state)), "init")
    return {"message": "Weight transfer initialized", "backend": ranks[0]["backend"], "ranks": ranks}


async def shutdown_transfer(request: web.Request, state: ServerState, body: JSONObject) -> JSONObject:
    await call(state, state.engine.shutdown_weight_transfer(rank_timeout(state)))
    return {"message": "Weight transfer shut down"}


async def start_update(request: web.Request, state: ServerState, body: JSONObject) -> JSONObject:
    ranks = await call(state, state.engine.start_weight_update(rank_timeout(state)), "start")
    return {"message": "Weight update started", "ranks": ranks}


async def update_weights(request: web.Request, state: ServerState, body: JSONObject) -> JSONObject:
    info = body.get("update_info")
    if not isinstance(info, dict):
        raise ApiError(400, "update_info must be an object", "update_info")
    try:
        ranks = await call(state, state.engine.update_weights(info, rank_timeout(state)), "update")
    except WeightFailure:
        # A refused update leaves no stage on any rank: those that staged must not keep theirs open
        # (the next start would meet it), and a rank that refused has dropped its own already.
        await _drop(state)
        raise
    digests = {r["staged_digest"] for r in ranks}
    if len(digests) != 1:
        await _drop(state)
        raise WeightFailure(500, "the ranks staged different weights; the update is dropped", ranks)
    return {"message": "Weights updated", "staged_digest": digests.pop(), "ranks": ranks}


async def finish_update(request: web.Request, state: ServerState, body: JSONObject) -> JSONObject:
    version = body.get("weight_version")
    if version is not None:
        version = _new_version(version, "weight_version")
    ranks = await _commit(state, version)
    return {"message": "Weight update finished", **_served(state), "ranks": ranks}


async def abort_update(request: web.Request, state: ServerState, body: JSONObject) -> JSONObject:
    ranks = await call(state, state.engine.abort_weight_update(rank_timeout(state)))
    return {"message": "Weight update dropped", "dropped": any(r["dropped"] for r in ranks), "ranks": ranks}


async def update_version(request: web.Request, state: ServerState, body: JSONObject) -> JSONObject:
    version = _new_version(body.get("new_version"), "new_version")
    ranks = await call(state, state.engine.update_weight_version(version, rank_timeout(state)))
    _serving(state, ranks)
    return {"success": True, "new_version": version}


async def weight_info(request: web.Request, state: ServerState, body: JSONObject) -> JSONObject:
    ranks = await call(state, state.engine.weight_info(rank_timeout(state)))
    _serving(state, ranks)
    versions = {r["weight_version"] for r in ranks}
    return {
        "weight_version": versions.pop() if len(versions) == 1 else MIXED_VERSION,
        "digest": ranks[0]["digest"],
        "paused": state.weights.paused is not None,
        "ranks": ranks,
    }


async def world_size(request: web.Request, state: ServerState, body: JSONObject) -> JSONObject:
    include_dp = request.query.get("include_dp", "true").lower() not in ("false", "0")
    return {"world_size": state.engine.info.num_ranks if include_dp else 1}


# ---- SGLang's ------------------------------------------------------------------------------------
async def update_from_disk(request: web.Request, state: ServerState, body: JSONObject) -> JSONObject:
    """SGLang's one-call update (fields of its `UpdateWeightFromDiskReqInput`): stage and swap; with
    `abort_all_requests` running requests are aborted first, and `keep_pause` leaves generation paused."""
    path = body.get("model_path")
    if not isinstance(path, str) or not path:
        raise ApiError(400, "model_path must name a checkpoint directory", "model_path")
    version = body.get("weight_version")
    if version is not None and version != "":
        version = _new_version(version, "weight_version")
    paused_here = bool(body.get("abort_all_requests")) and state.weights.paused is None
    if paused_here:
        await pause_mode(state, "abort")
    await call(state, state.engine.start_weight_update(rank_timeout(state)), "start")
    try:
        ranks = await call(
            state, state.engine.update_weights({"model_path": path}, rank_timeout(state)), "update"
        )
    except WeightFailure:
        await _drop(state)
        raise
    await _commit(state, version if isinstance(version, str) and version else None)
    if paused_here and not body.get("keep_pause"):
        await call(state, state.engine.resume_generation(rank_timeout(state)), "resume")
        state.weights.paused = None
        state.metrics.weights.paused.set(0)
    return {
        "success": True,
        "message": "Succeeded to update model weights.",
        "num_paused_requests": 0,
        **_served(state),
        "ranks": ranks,
    }


async def pause_mode(state: ServerState, mode: str) -> None:
    try:
        parsed = PauseMode(mode)
    except ValueError:
        modes = ", ".join(m.value for m in PauseMode)
        raise WeightFailure(400, f"mode must be one of {modes}, got {mode!r}") from None
    await call(state, state.engine.pause_generation(parsed, rank_timeout(state)), "pause")
    state.weights.paused = mode
    state.metrics.weights.paused.set(1)


# ---- the commit -----------------------------------------------------------------------------------
async def _commit(state: ServerState, version: str | None) -> list[JSONObject]:
    """Swap on every rank, only once every rank staged the same weights."""
    staged = await call(state, state.engine.weight_info(rank_timeout(state)))
    missing = [r["rank"] for r in staged if not r["staging"]]
    if missing:
        raise WeightFailure(
            409, f"no weight update is started on rank {missing} (call /start_weight_update)", staged
        )
    if len({r["staged_digest"] for r in staged}) != 1:
        await _drop(state)
        raise WeightFailure(500, "the ranks staged different weights; the update is dropped", staged)
    try:
        ranks = await call(state, state.engine.finish_weight_update(version, rank_timeout(state)), "finish")
    except WeightFailure as fail:
        done = [r for r in fail.ranks if "error" not in r]
        if done:  # some ranks swapped, some did not: mixed weights must not be served
            reason = f"weight swap failed on some ranks ({fail.message}); the ranks may hold mixed weights"
            state.engine.mark_unhealthy(reason)
            log.error("%s", reason)
            raise WeightFailure(500, reason, fail.ranks) from None
        raise
    _serving(state, ranks)
    state.metrics.weights.updates.labels("success").inc()
    log.info("weights %s (%s) serving on %d rank(s)", state.weights.version, state.weights.digest, len(ranks))
    return ranks


async def _drop(state: ServerState) -> None:
    try:
        await state.engine.abort_weight_update(rank_timeout(state))
    except EngineDeadError:
        pass


def rank_timeout(state: ServerState) -> float:
    """How long a weight operation may take on a rank before it counts as failed there."""
    return state.settings.weight_update_timeout


def _new_version(value: object, field: str) -> str:
    """A version a caller names: a non-empty string, and not one of the names the daemon itself reports
    (`initial`: weights loaded unnamed, whose block keys carry no version; `mixed`: ranks that differ), so
    those always mean what they say."""
    if not isinstance(value, str) or not value:
        raise ApiError(400, f"{field} must be a non-empty string", field)
    if value in RESERVED_VERSIONS:
        raise ApiError(400, f"{field} {value!r} is reserved: the daemon reports it itself", field)
    return value


def _serving(state: ServerState, ranks: list[JSONObject]) -> None:
    state.weights.version = ranks[0]["weight_version"]
    state.weights.digest = ranks[0].get("digest") or state.weights.digest
    state.metrics.weights.serving(state.weights.version, state.weights.digest)


def _served(state: ServerState) -> JSONObject:
    return {"weight_version": state.weights.version, "digest": state.weights.digest}


# The route table (app.py adds it): (method, path, handler).
ROUTES: list[tuple[str, str, RouteHandler]] = [
    ("POST", "/pause", route(pause)),
    ("POST", "/resume", route(resume)),
    ("GET", "/is_paused", route(is_paused)),
    ("POST", "/abort_requests", route(abort_requests)),
    ("POST", "/init_weight_transfer_engine", route(init_transfer)),
    ("POST", "/shutdown_weight_transfer_engine", route(shutdown_transfer)),
    ("POST", "/start_weight_update", route(start_update)),
    ("POST", "/update_weights", route(update_weights)),
    ("POST", "/finish_weight_update", route(finish_update)),
    ("POST", "/abort_weight_update", route(abort_update)),
    ("POST", "/update_weight_version", route(update_version)),
    ("GET", "/weight_info", route(weight_info)),
    ("GET", "/get_world_size", route(world_size)),
    ("POST", "/update_weights_from_disk", route(update_from_disk, sglang=True)),
]
