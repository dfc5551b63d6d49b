"""The OpenAI generation routes: `/v1/completions` and `/v1/chat/completions`, streaming or not.

A request becomes one engine request per prompt; tokens come back through the engine loop and are
detokenized, cut at stop strings and sent as JSON or server-sent events. Whatever ends a handler early
(client gone, error) aborts its engine requests, so their blocks are freed before the next step.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from kvpilot.daemon.engine.engine_loop import EngineDeadError
from kvpilot.daemon.engine.outputs import RequestOutput
from kvpilot.daemon.server.app_state import STATE, ServerState, running_loop
from kvpilot.daemon.server.detokenizer import IncrementalDetokenizer, StopStrings
from kvpilot.daemon.server.protocol import (
    ApiError,
    GenerateRequest,
    bad,
    parse_chat,
    parse_completion,
    parse_json_object,
)


@dataclass(slots=True)
class _Piece:
    text: str
    finish_reason: str | None
    output: RequestOutput


async def _generate(
    state: ServerState, request_id: str, prompt_ids: list[int], req: GenerateRequest, arrival: float
) -> AsyncIterator[_Piece]:
    """One prompt's text deltas; aborts the engine request if the consumer goes away early."""
    loop = running_loop(state)
    m = state.metrics
    try:
        # Each engine request gets its own params: a batch of prompts must not share one mutable object.
        sink = await loop.add(request_id, prompt_ids, dataclasses.replace(req.params), req.cache_salt)
    except ValueError as exc:  # RequestRejected, SamplingError: the client's input
        raise bad(str(exc), getattr(exc, "param", None)) from None
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


def _usage(state: ServerState, outputs: list[RequestOutput]) -> dict:
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


def _check_length(state: ServerState, prompt_ids: list[int], req: GenerateRequest, param: str) -> None:
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
    state: ServerState,
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
    state: ServerState,
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
