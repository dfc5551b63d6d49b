"""vLLM's runtime LoRA routes: `POST /v1/load_lora_adapter {lora_name, lora_path, load_inplace}` and
`POST /v1/unload_lora_adapter {lora_name}`, with vLLM's bodies and messages (`vllm/entrypoints/openai/
models/serving.py`, vLLM 0.33), so RL trainers written for vLLM drive this daemon unchanged. Both need the
admin token; the replies carry kvpilot's extras beside vLLM's message (`digest`, `ranks`).

Each runs on every rank (`routes.call`): never 200 unless every rank did it. A load that some ranks
did and others refused is undone everywhere, so no two ranks serve one name with different weights. An
in-place load gives the adapter a new identity (its files' digest): requests already running finish with
the weights they started with, and no block they computed is served to a later request.
"""

from __future__ import annotations

import logging
from typing import cast

from aiohttp import web

from kvpilot.daemon.engine.weights.lora import LoRAError, ServedAdapter, check_name
from kvpilot.daemon.server.app_state import ServerState
from kvpilot.daemon.server.weights.routes import (
    RouteHandler,
    WeightFailure,
    call,
    no_answer,
    rank_timeout,
    route,
)
from kvpilot.kv.reset_scope import ResetScope
from kvpilot.protocol import JSONObject
from kvpilot.protocol.errors import ApiError

log = logging.getLogger(__name__)

MAX_PATH_CHARS = 4096


async def load_lora_adapter(request: web.Request, state: ServerState, body: JSONObject) -> JSONObject:
    name = _lora_name(body)
    path = body.get("lora_path")
    if not isinstance(path, str) or not path or len(path) > MAX_PATH_CHARS:
        raise ApiError(
            400, f"lora_path must be a non-empty string of at most {MAX_PATH_CHARS} characters", "lora_path"
        )
    inplace = body.get("load_inplace", False)
    if not isinstance(inplace, bool):
        raise ApiError(400, "load_inplace must be true or false", "load_inplace")
    if name in state.served:
        raise ApiError(400, f"lora_name {name!r} is the base model's name", "lora_name")
    async with state.lora_lock:  # one load or unload at a time: the ranks see them in one order
        if name in state.adapters and not inplace:
            raise ApiError(
                400, f"The lora adapter '{name}' has already been loaded.", "lora_name", code="lora_exists"
            )
        previous = state.adapters.get(name)
        try:
            ranks = await call(
                state, state.engine.load_lora_adapter(name, path, inplace, rank_timeout(state))
            )
            if len({r["digest"] for r in ranks}) != 1:
                raise WeightFailure(500, "the ranks read different adapter files", ranks)
        except WeightFailure as fail:
            # Some ranks took it, or may yet (no answer in time: the read goes on): none may serve it
            # alone, and a rank's late load is dropped once the undo came after it started.
            if any("error" not in r or no_answer(r) for r in fail.ranks):
                await _undo(state, name, previous)
            if fail.status == 400:
                fail.code = "invalid_lora_adapter"
            raise
        state.set_adapter(name, ServedAdapter(path, ranks[0]["digest"]))
        if previous is not None:
            await _unpin(state, name)
    log.info(
        "LoRA adapter %s %s from %s (digest %s)",
        name,
        "reloaded" if inplace else "loaded",
        path,
        ranks[0]["digest"][:12],
    )
    return {
        "message": f"Success: LoRA adapter '{name}' added successfully.",
        "lora_name": name,
        "digest": ranks[0]["digest"],
        "ranks": ranks,
    }


async def unload_lora_adapter(request: web.Request, state: ServerState, body: JSONObject) -> JSONObject:
    name = _lora_name(body)
    async with state.lora_lock:
        if name not in state.adapters:
            raise ApiError(
                404, f"The lora adapter '{name}' cannot be found.", "lora_name", code="lora_not_found"
            )
        state.set_adapter(name, None)  # no new request names it from here on
        ranks = await call(state, state.engine.unload_lora_adapter(name, rank_timeout(state)))
        state.metrics.forget_adapter(name)
        await _unpin(state, name)
    log.info("LoRA adapter %s unloaded", name)
    return {
        "message": f"Success: LoRA adapter '{name}' removed successfully.",
        "lora_name": name,
        "ranks": ranks,
    }


async def _undo(state: ServerState, name: str, previous: ServedAdapter | None) -> None:
    """After a load that some ranks took and others did not: the adapter as it was before on every rank
    (its previous files again, in place), or, where there was none or that fails too, on none."""
    timeout = rank_timeout(state)
    try:
        if previous is not None:
            ranks = await state.engine.load_lora_adapter(name, previous.path, True, timeout)
            # a rank without an error has its value
            if all(r.error is None and cast(JSONObject, r.value)["digest"] == previous.digest for r in ranks):
                log.warning(
                    "LoRA adapter %s: the failed load is undone, %s serves again", name, previous.path
                )
                return
        state.set_adapter(name, None)
        await state.engine.unload_lora_adapter(name, timeout)  # ranks without it answer 404
        log.warning("LoRA adapter %s: unloaded after a load that not every rank took", name)
    except Exception:  # noqa: BLE001 - the load's own failure is what the caller must hear
        state.set_adapter(name, None)
        log.exception("LoRA adapter %s: undoing a failed load", name)


async def _unpin(state: ServerState, name: str) -> None:
    """Let go of the pins of an adapter unloaded or loaded again in place: its old identity keyed those
    blocks, so no request can hit them again, and they would hold their share of the pin cap until an admin
    unpinned or reset. Best effort: a rank that fails keeps them until then (logged)."""
    if not state.engine.info.enable_prefix_caching:
        return
    for r in await state.engine.unpin_ranks(rank_timeout(state), ResetScope(lora_name=name)):
        if r.error is not None:
            log.warning("LoRA adapter %s: its pins stay on rank %d: %s", name, r.rank, r.error)


def _lora_name(body: JSONObject) -> str:
    try:
        return check_name(body.get("lora_name"))
    except LoRAError as exc:
        raise ApiError(400, f"lora_name: {exc}", "lora_name") from None


# The route table (app.py adds it): (method, path, handler).
ROUTES: list[tuple[str, str, RouteHandler]] = [
    ("POST", "/v1/load_lora_adapter", route(load_lora_adapter)),
    ("POST", "/v1/unload_lora_adapter", route(unload_lora_adapter)),
]
