"""The daemon's HTTP server: OpenAI-compatible generation plus the prefix-cache operations.

`create_app(engine, settings)` builds the aiohttp application; `serve(engine, settings)` runs it until
SIGTERM/SIGINT and drains. All engine access goes through `EngineLoop` (one engine thread).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import signal
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from kvpilot.daemon.auth import authorized
from kvpilot.daemon.detokenizer import IncrementalDetokenizer, StopStrings
from kvpilot.daemon.engine_loop import EngineDeadError, EngineLoop
from kvpilot.daemon.metrics import DaemonMetrics
from kvpilot.daemon.outputs import RequestOutput
from kvpilot.daemon.protocol import (
    ApiError,
    GenerateRequest,
    bad,
    parse_chat,
    parse_completion,
    parse_json_object,
    parse_reset_flag,
)

log = logging.getLogger(__name__)

GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions")


@dataclass(slots=True)
class ServerSettings:
    host: str = "0.0.0.0"
    port: int = 8000
    served_model_names: list[str] = field(default_factory=list)  # empty: the engine's model name
    admin_token: str | None = None
    max_body_bytes: int = 4 << 20  # a full 128k-token context as JSON fits well below this
    shutdown_timeout: float = 30.0  # SIGTERM grace period for in-flight requests


@dataclass(slots=True)
class _State:
    engine: Any
    settings: ServerSettings
    served: list[str]
    metrics: DaemonMetrics
    loop: EngineLoop | None = None
    draining: bool = False
    in_flight: int = 0
    idle: asyncio.Event = field(default_factory=asyncio.Event)
    created: int = field(default_factory=lambda: int(time.time()))


STATE = web.AppKey("kvpilot_state", _State)


# ---- app -----------------------------------------------------------------------------------------
def create_app(engine: Any, settings: ServerSettings | None = None) -> web.Application:
    settings = settings or ServerSettings()
    served = list(settings.served_model_names) or [engine.model_name]
    state = _State(engine, settings, served, metrics=None)  # type: ignore[arg-type]
    state.metrics = DaemonMetrics(lambda: state.loop.state.stats if state.loop else None)
    state.idle.set()
    app = web.Application(client_max_size=settings.max_body_bytes, middlewares=[_error_middleware])
    app[STATE] = state
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/reset_prefix_cache", reset_prefix_cache)
    app.router.add_get("/prefix_cache", prefix_cache)
    app.on_startup.append(_start_engine_loop)
    app.on_cleanup.append(_stop_engine_loop)
    return app


async def _start_engine_loop(app: web.Application) -> None:
    state = app[STATE]
    state.loop = EngineLoop(state.engine, asyncio.get_running_loop())
    state.loop.start()


async def _stop_engine_loop(app: web.Application) -> None:
    if app[STATE].loop is not None:
        await app[STATE].loop.stop()


def _error_response(err: ApiError, extra: dict | None = None) -> web.Response:
    return web.json_response({**(extra or {}), **err.body()}, status=err.status)


@web.middleware
async def _error_middleware(request: web.Request, handler: Any) -> web.StreamResponse:
    """Every failure leaves as OpenAI's error JSON; ours (5xx) never carry a stack trace."""
    state = request.app[STATE]
    generation = request.path in GENERATION_PATHS
    if generation and state.draining:
        return _error_response(ApiError(503, "the server is shutting down", code="shutting_down"))
    state.in_flight += 1
    state.idle.clear()
    try:
        return await handler(request)
    except ApiError as err:
        return _error_response(err)
    except web.HTTPRequestEntityTooLarge:
        limit = state.settings.max_body_bytes
        return _error_response(
            ApiError(413, f"the request body exceeds {limit} bytes", code="request_too_large")
        )
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return _error_response(ApiError(exc.status, exc.reason or "error"))
    except EngineDeadError:
        return _error_response(ApiError(503, "the engine is not running", code="engine_unavailable"))
    except (asyncio.CancelledError, ConnectionResetError):
        raise
    except Exception:
        log.exception("unhandled error on %s %s", request.method, request.path)
        return _error_response(ApiError(500, "internal server error", code="internal_error"))
    finally:
        state.in_flight -= 1
        if state.in_flight == 0:
            state.idle.set()


# ---- operations ----------------------------------------------------------------------------------
async def health(request: web.Request) -> web.Response:
    state = request.app[STATE]
    if state.draining:
        return web.json_response({"status": "draining"}, status=503)
    if state.loop is None or not state.loop.alive:
        reason = state.loop.error if state.loop else "starting"
        return web.json_response({"status": "unhealthy", "reason": reason}, status=503)
    return web.json_response({"status": "ok"})


async def metrics(request: web.Request) -> web.Response:
    body = request.app[STATE].metrics.render()
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


async def models(request: web.Request) -> web.Response:
    state = request.app[STATE]
    data = [
        {
            "id": name,
            "object": "model",
            "created": state.created,
            "owned_by": "kvpilot",
            "root": state.served[0],
            "max_model_len": state.engine.max_model_len,
        }
        for name in state.served
    ]
    return web.json_response({"object": "list", "data": data})


async def prefix_cache(request: web.Request) -> web.Response:
    state = request.app[STATE]
    loop = _running_loop(state)
    stats = await loop.call(lambda engine: engine.stats())
    body = stats.to_dict()
    body.pop("extra", None)
    body["enable_prefix_caching"] = bool(state.engine.config.enable_prefix_caching)
    body["engine_steps"] = loop.state.steps
    return web.json_response(body)


async def reset_prefix_cache(request: web.Request) -> web.Response:
    state = request.app[STATE]
    m = state.metrics.resets
    if not authorized(request.headers.get("Authorization"), state.settings.admin_token):
        m.labels("unauthorized").inc()
        raise ApiError(401, "a valid admin token is required: Authorization: Bearer <token>",
                       code="invalid_admin_token")  # fmt: skip
    raw = await request.read()
    body = parse_json_object(raw) if raw.strip() else None
    flag = parse_reset_flag(request.query.get("reset_running_requests"), body)
    if not hasattr(state.engine, "reset_prefix_cache"):
        m.labels("failed").inc()
        raise ApiError(501, "this engine has no prefix cache to reset", code="not_supported")
    try:
        loop = _running_loop(state)
        result = await loop.call(lambda engine: engine.reset_prefix_cache(flag))
    except EngineDeadError:
        m.labels("unavailable").inc()
        raise ApiError(503, "the engine is not running", code="engine_unavailable") from None
    except NotImplementedError:
        m.labels("failed").inc()
        raise ApiError(501, "this engine cannot reset its prefix cache", code="not_supported") from None
    except Exception as exc:  # noqa: BLE001 - reported per rank, honestly, without a stack trace
        log.exception("prefix cache reset failed")
        m.labels("failed").inc()
        ranks = [{"rank": 0, "success": False, "error": f"reset failed: {type(exc).__name__}"}]
        err = ApiError(500, "the prefix cache reset failed on rank 0", code="reset_failed")
        return _error_response(err, {"success": False, "ranks": ranks})
    rank = result.to_dict()
    if not result.success:
        m.labels("failed").inc()
        err = ApiError(500, f"the prefix cache reset failed on rank {result.rank}", code="reset_failed")
        return _error_response(err, {"success": False, "ranks": [rank]})
    m.labels("success").inc()
    log.info(
        "prefix cache reset: epoch %d, %d blocks evicted, %d in flight, %d preempted, %.2f ms",
        result.epoch, result.evicted_blocks, result.in_flight_requests, result.preempted_requests,
        result.duration_ms,
    )  # fmt: skip
    return web.json_response(
        {
            "success": True,
            "epoch": result.epoch,
            "evicted_blocks": result.evicted_blocks,
            "in_flight_requests": result.in_flight_requests,
            "preempted_requests": result.preempted_requests,
            "duration_ms": result.duration_ms,
            "ranks": [rank],
        }
    )


def _running_loop(state: _State) -> EngineLoop:
    if state.loop is None or not state.loop.alive:
        raise EngineDeadError("the engine loop is not running")
    return state.loop


# ---- generation ----------------------------------------------------------------------------------
@dataclass(slots=True)
class _Piece:
    text: str
    finish_reason: str | None
    output: RequestOutput


async def _generate(
    state: _State, request_id: str, prompt_ids: list[int], req: GenerateRequest, arrival: float
) -> AsyncIterator[_Piece]:
    """One prompt's text deltas; aborts the engine request if the consumer goes away early."""
    loop = _running_loop(state)
    m = state.metrics
    try:
        sink = await loop.add(request_id, prompt_ids, req.params, req.cache_salt)
    except ValueError as exc:  # RequestRejected, SamplingError: the client's input
        raise bad(str(exc), "prompt" if "prompt" in str(exc) else None) from None
    detok = IncrementalDetokenizer(state.engine.tokenizer)
    stops = StopStrings(req.stop)
    last = arrival
    first = True
    finished = False
    try:
        while True:
            item = await sink.get()
            if isinstance(item, BaseException):  # the engine died under this request: our fault, a 500
                raise ApiError(500, "the engine failed while running this request", code="engine_error")
            now = time.monotonic()
            if first:
                first = False
                m.ttft.observe(now - arrival)
                m.prompt_tokens.inc(item.num_prompt_tokens)
            else:
                m.itl.observe(now - last)
            last = now
            m.generation_tokens.inc(len(item.new_token_ids))
            text, stopped = stops.feed(detok.push(item.new_token_ids, item.finished), item.finished)
            reason = "stop" if stopped else item.finish_reason if item.finished else None
            if reason is not None:
                finished = True
                m.e2e.observe(now - arrival)
                if stopped and not item.finished:
                    loop.abort(request_id)
            yield _Piece(text, reason, item)
            if finished:
                return
    finally:
        if not finished:
            loop.abort(request_id)  # client gone or engine failed: free the blocks before the next step


def _usage(state: _State, outputs: list[RequestOutput]) -> dict:
    prompt = sum(o.num_prompt_tokens for o in outputs)
    completion = sum(o.num_output_tokens for o in outputs)
    usage: dict[str, Any] = {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }
    if state.engine.config.enable_prefix_caching:
        usage["prompt_tokens_details"] = {"cached_tokens": sum(o.num_cached_tokens for o in outputs)}
    return usage


def _check_length(state: _State, prompt_ids: list[int], req: GenerateRequest, param: str) -> None:
    limit = state.engine.max_model_len
    n = len(prompt_ids)
    if n == 0:
        raise bad("the prompt is empty after tokenization", param)
    if n >= limit:
        raise bad(
            f"This model's maximum context length is {limit} tokens; the prompt has {n} tokens "
            "(at least one token must be left for the completion)",
            param,
            code="context_length_exceeded",
        )
    room = limit - n
    if req.max_tokens_given and req.params.max_tokens > room:
        raise bad(
            f"This model's maximum context length is {limit} tokens; you requested {n + req.params.max_tokens} "
            f"tokens ({n} in the prompt, {req.params.max_tokens} for the completion)",
            req.max_tokens_param,
            code="context_length_exceeded",
        )
    if not req.max_tokens_given:
        req.params.max_tokens = min(req.params.max_tokens, room)


async def completions(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    arrival = time.monotonic()
    req = parse_completion(parse_json_object(await request.read()), state.served)
    tok = state.engine.tokenizer
    prompt_ids = [p if isinstance(p, list) else tok.encode(p, add_special_tokens=True) for p in req.prompts]
    for ids in prompt_ids:
        _check_length(state, ids, req, "prompt")
    rid = f"cmpl-{uuid.uuid4().hex}"
    return await _respond(request, state, req, rid, prompt_ids, arrival, chat=False)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    arrival = time.monotonic()
    chat = parse_chat(parse_json_object(await request.read()), state.served)
    req = chat.generate
    tok = state.engine.tokenizer
    try:
        text = tok.apply_chat_template(
            chat.messages, tokenize=False, add_generation_prompt=chat.add_generation_prompt
        )
    except Exception as exc:  # noqa: BLE001 - template errors (e.g. role order) are the client's input
        raise bad(f"the messages do not fit the model's chat template: {exc}", "messages") from None
    ids = tok.encode(text, add_special_tokens=False)
    if not req.max_tokens_given:
        req.params.max_tokens = state.engine.max_model_len  # clamped to the room left below
    _check_length(state, ids, req, "messages")
    rid = f"chatcmpl-{uuid.uuid4().hex}"
    return await _respond(request, state, req, rid, [ids], arrival, chat=True)


async def _respond(
    request: web.Request,
    state: _State,
    req: GenerateRequest,
    rid: str,
    prompts: list[list[int]],
    arrival: float,
    chat: bool,
) -> web.StreamResponse:
    created = int(time.time())
    # Each prompt of a batch is its own engine request; they run side by side.
    ids = [rid if len(prompts) == 1 else f"{rid}-{i}" for i in range(len(prompts))]
    gens = [_generate(state, ids[i], p, req, arrival) for i, p in enumerate(prompts)]
    if req.stream:
        return await _stream(request, state, req, rid, created, gens, chat)
    texts = [""] * len(gens)
    reasons: list[str | None] = [None] * len(gens)
    finals: list[RequestOutput | None] = [None] * len(gens)
    async with _merged(gens) as events:
        async for i, piece in events:
            texts[i] += piece.text
            reasons[i] = piece.finish_reason or reasons[i]
            finals[i] = piece.output
    usage = _usage(state, [f for f in finals if f is not None])
    if chat:
        choices = [
            {"index": 0, "message": {"role": "assistant", "content": texts[0]}, "logprobs": None,
             "finish_reason": reasons[0]}
        ]  # fmt: skip
        obj = "chat.completion"
    else:
        choices = [
            {"index": i, "text": texts[i], "logprobs": None, "finish_reason": reasons[i]}
            for i in range(len(gens))
        ]
        obj = "text_completion"
    return web.json_response(
        {"id": rid, "object": obj, "created": created, "model": req.model, "choices": choices, "usage": usage}
    )


@contextlib.asynccontextmanager
async def _merged(gens: list[AsyncIterator[_Piece]]) -> AsyncIterator[AsyncIterator[tuple[int, _Piece]]]:
    """Interleave several generations as (index, piece); an error in one ends all of them."""
    if len(gens) == 1:
        gen = gens[0]

        async def single() -> AsyncIterator[tuple[int, _Piece]]:
            async for piece in gen:
                yield 0, piece

        try:
            yield single()
        finally:
            await gen.aclose()
        return

    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(i: int, gen: AsyncIterator[_Piece]) -> None:
        try:
            async for piece in gen:
                await queue.put((i, piece))
            await queue.put((i, done))
        except BaseException as exc:  # noqa: BLE001 - forwarded to the consumer
            await queue.put((i, exc))
            if isinstance(exc, asyncio.CancelledError):
                raise

    tasks = [asyncio.create_task(pump(i, g)) for i, g in enumerate(gens)]

    async def events() -> AsyncIterator[tuple[int, _Piece]]:
        remaining = len(tasks)
        while remaining:
            i, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item

    try:
        yield events()
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _stream(
    request: web.Request,
    state: _State,
    req: GenerateRequest,
    rid: str,
    created: int,
    gens: list[AsyncIterator[_Piece]],
    chat: bool,
) -> web.StreamResponse:
    obj = "chat.completion.chunk" if chat else "text_completion"

    def chunk(choices: list[dict], usage: dict | None = None) -> bytes:
        body: dict[str, Any] = {
            "id": rid,
            "object": obj,
            "created": created,
            "model": req.model,
            "choices": choices,
        }
        if usage is not None:
            body["usage"] = usage
        return b"data: " + json.dumps(body, separators=(",", ":")).encode() + b"\n\n"

    def choice(i: int, text: str | None, reason: str | None, first: bool = False) -> dict:
        if not chat:
            return {"index": i, "text": text or "", "logprobs": None, "finish_reason": reason}
        delta: dict[str, Any] = {}
        if first:
            delta["role"] = "assistant"
        if text is not None:
            delta["content"] = text
        return {"index": i, "delta": delta, "logprobs": None, "finish_reason": reason}

    async with _merged(gens) as events:
        # Pull the first event before sending headers: an invalid request still gets a proper 4xx.
        first = await anext(events, None)
        resp = web.StreamResponse(
            headers={
                "Content-Type": "text/event-stream",
                "Cache-Control": "no-cache",
                "X-Accel-Buffering": "no",
            }
        )
        await resp.prepare(request)
        finals: dict[int, RequestOutput] = {}
        if chat:
            await resp.write(chunk([choice(0, "", None, first=True)]))
        try:
            pending = [first] if first is not None else []
            async for ev in _chain(pending, events):
                i, piece = ev
                finals[i] = piece.output
                if piece.text or piece.finish_reason:
                    text = piece.text if piece.text or not chat else None
                    await resp.write(chunk([choice(i, text, piece.finish_reason)]))
        except (EngineDeadError, ApiError) as exc:
            err = (
                exc if isinstance(exc, ApiError) else ApiError(500, "the engine failed", code="engine_error")
            )
            await resp.write(b"data: " + json.dumps(err.body()).encode() + b"\n\n")
        if req.include_usage:
            await resp.write(chunk([], _usage(state, list(finals.values()))))
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp


async def _chain(first: list, rest: AsyncIterator) -> AsyncIterator:
    for item in first:
        yield item
    async for item in rest:
        yield item


# ---- running -------------------------------------------------------------------------------------
async def serve(engine: Any, settings: ServerSettings) -> int:
    """Serve until SIGTERM or SIGINT, then drain: stop accepting, let in-flight requests finish within
    `shutdown_timeout`, stop the engine, return 0."""
    app = create_app(engine, settings)
    # handler_cancellation: a client that disconnects cancels its handler at once, whose `finally`
    # aborts the engine request, so its blocks are freed before the next step.
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=5.0)
    await runner.setup()
    site = web.TCPSite(runner, settings.host, settings.port)
    await site.start()
    state = app[STATE]
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    log.info(
        "serving %s on http://%s:%d (admin token %s, max body %d bytes)",
        ", ".join(state.served), settings.host, settings.port,
        "required" if settings.admin_token else "off", settings.max_body_bytes,
    )  # fmt: skip
    await stop.wait()
    log.info("shutting down: no new requests; draining %d in flight (up to %.0f s)",
             state.in_flight, settings.shutdown_timeout)  # fmt: skip
    state.draining = True
    await site.stop()  # stop listening; open connections finish their current request
    try:
        await asyncio.wait_for(state.idle.wait(), settings.shutdown_timeout)
    except asyncio.TimeoutError:
        log.warning("grace period over with %d requests in flight; aborting them", state.in_flight)
    await runner.cleanup()
    log.info("stopped")
    return 0
