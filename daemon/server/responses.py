"""A generation's reply, from the deltas of its sequences: one JSON body (`complete`) or server-sent events
(`stream`: a chunk per delta, the usage chunk, `[DONE]`), each with the weights that computed it as
`system_fingerprint` and the prompt tokens served from cache in `usage`."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncGenerator, AsyncIterator
from typing import cast

from aiohttp import web

from kvpilot.daemon.engine.client import EngineDeadError
from kvpilot.daemon.engine.outputs import RequestOutput
from kvpilot.daemon.server.app_state import ServerState
from kvpilot.daemon.server.choices import Choice, Delta, PromptEcho, chat_logprobs, completion_logprobs
from kvpilot.daemon.server.disagg import HoldReply, reply_params
from kvpilot.daemon.server.prepare import Prepared
from kvpilot.protocol import JSONObject
from kvpilot.protocol.errors import ApiError
from kvpilot.protocol.fields import ignored_fields_headers
from kvpilot.protocol.pins import PinResult
from kvpilot.protocol.replies import json_response
from kvpilot.protocol.requests import GenerateRequest


def usage(state: ServerState, finals: dict[tuple[int, int], RequestOutput]) -> JSONObject:
    """OpenAI's usage of a reply; with prefix caching, the prompt tokens served from cache."""
    firsts = [o for (_, j), o in finals.items() if j == 0]  # the prompt counts once per prompt
    prompt = sum(o.num_prompt_tokens for o in firsts)
    completion = sum(o.num_output_tokens for o in finals.values())
    out: JSONObject = {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }
    if state.engine.info.enable_prefix_caching:
        out["prompt_tokens_details"] = {"cached_tokens": sum(o.num_cached_tokens for o in firsts)}
    return out


def pinned(req: GenerateRequest, finals: dict[tuple[int, int], RequestOutput]) -> JSONObject | None:
    """The reply's `pin_prefix` when the request asked for it (None when not): whether every prompt's full
    blocks were pinned, how many blocks, and the first reason one was not (engine/outputs.py `PinResult`,
    or the server's own refusal)."""
    if req.pin_refused is not None:
        return {"pinned": False, "blocks": 0, "reason": req.pin_refused}
    if not req.pin_prefix:
        return None
    pins = [o.pin or PinResult(False, reason="aborted") for (_, j), o in finals.items() if j == 0]
    pins = pins or [PinResult(False, reason="aborted")]
    return {
        "pinned": all(p.pinned for p in pins),
        "blocks": sum(p.blocks for p in pins),
        "reason": next((p.reason for p in pins if p.reason), None),
    }


# ---- routes -------------------------------------------------------------------------------------


async def complete(
    state: ServerState,
    prep: Prepared,
    rid: str,
    gens: list[AsyncGenerator[Delta, None]],
    hold: HoldReply | None = None,
) -> web.Response:
    """The reply as one JSON body; `hold`: a prefill for a remote decode, whose reply carries the
    `kv_transfer_params` the decode pod pulls with (vLLM's place: the top level)."""
    req = prep.req
    created = int(time.time())
    choices: dict[tuple[int, int], Choice] = {}
    echoes: dict[int, PromptEcho] = {}
    async with _merged(gens) as events:
        async for i, d in events:
            if d.output.restart:  # recomputed under new weights: start the choice over
                choices[(i, d.index)] = Choice()
                continue
            c = choices.setdefault((i, d.index), Choice())
            if d.echo is not None:
                echoes[i] = d.echo
            c.text += d.text
            if d.logprobs is not None:
                c.logprobs.extend(d.logprobs)
            c.finish_reason = d.finish_reason or c.finish_reason
            c.output = d.output
    finals = {k: c.output for k, c in choices.items() if c.output is not None}
    body_choices = []
    for i in range(len(prep.prompts)):
        group = sorted((j, c) for (p, j), c in choices.items() if p == i)
        if req.params.n > req.n:  # best_of: the n sequences most likely as a whole
            group.sort(key=lambda jc: -cast(RequestOutput, jc[1].output).cumulative_logprob)
        for k, (_, c) in enumerate(group[: req.n]):
            body_choices.append(_final_choice(prep, i * req.n + k, c, echoes.get(i)))
    obj = "chat.completion" if prep.chat else "text_completion"
    versions = {o.weight_version for o in finals.values()} or {state.weights.version}
    body: JSONObject = {
        "id": rid,
        "object": obj,
        "created": created,
        "model": req.model,
        "system_fingerprint": versions.pop() if len(versions) == 1 else "mixed",
        "choices": body_choices,
        "usage": usage(state, finals),
    }
    if (pin := pinned(req, finals)) is not None:
        body["pin_prefix"] = pin
    if hold is not None:
        body["kv_transfer_params"] = reply_params(state, hold, list(finals.values()))
    return json_response(body, headers=ignored_fields_headers(req.ignored_fields))


def _final_choice(prep: Prepared, index: int, c: Choice, echo: PromptEcho | None) -> JSONObject:
    wants_logprobs = prep.req.params.logprobs is not None
    if prep.chat:
        return {
            "index": index,
            "message": {"role": "assistant", "content": c.text},
            "logprobs": chat_logprobs(c.logprobs) if wants_logprobs else None,
            "finish_reason": c.finish_reason,
        }
    text, entries = c.text, c.logprobs
    if echo is not None:
        text = echo.text + text
        entries = (echo.logprobs or []) + entries
    return {
        "index": index,
        "text": text,
        "logprobs": completion_logprobs(entries) if wants_logprobs else None,
        "finish_reason": c.finish_reason,
    }


@contextlib.asynccontextmanager
async def _merged(gens: list[AsyncGenerator[Delta, None]]) -> AsyncIterator[AsyncIterator[tuple[int, Delta]]]:
    """Interleave several generations as (index, delta); an error in one ends all of them."""
    if len(gens) == 1:
        gen = gens[0]

        async def single() -> AsyncIterator[tuple[int, Delta]]:
            async for piece in gen:
                yield 0, piece

        try:
            yield single()
        finally:
            await gen.aclose()
        return

    queue: asyncio.Queue[tuple[int, Delta | BaseException | None]] = asyncio.Queue()  # None: i is done

    async def pump(i: int, gen: AsyncIterator[Delta]) -> None:
        try:
            async for piece in gen:
                await queue.put((i, piece))
            await queue.put((i, None))
        except BaseException as exc:  # noqa: BLE001 - forwarded to the consumer
            await queue.put((i, exc))
            if isinstance(exc, asyncio.CancelledError):
                raise

    tasks = [asyncio.create_task(pump(i, g)) for i, g in enumerate(gens)]

    async def events() -> AsyncIterator[tuple[int, Delta]]:
        remaining = len(tasks)
        while remaining:
            i, item = await queue.get()
            if item is None:
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


async def stream(
    request: web.Request,
    state: ServerState,
    prep: Prepared,
    rid: str,
    gens: list[AsyncGenerator[Delta, None]],
) -> web.StreamResponse:
    async with _merged(gens) as events:
        # Pull the first event before sending headers: an invalid request still gets a proper 4xx.
        first = await anext(events, None)
        resp = web.StreamResponse(
            headers={
                "Content-Type": "text/event-stream",
                "Cache-Control": "no-cache",
                "X-Accel-Buffering": "no",
                **ignored_fields_headers(prep.req.ignored_fields),
            }
        )
        try:
            await resp.prepare(request)
            await _EventStream(state, prep, rid).write(resp, first, events)
        except ConnectionResetError:
            pass  # the client left mid-stream: leaving the block aborts its engine requests
        return resp


class _EventStream:
    """One streamed reply's server-sent events: a chunk per delta, the usage chunk, `[DONE]`."""

    def __init__(self, state: ServerState, prep: Prepared, rid: str) -> None:
        self.state = state
        self.req = prep.req
        self.chat = prep.chat
        self.rid = rid
        self.created = int(time.time())
        self.object = "chat.completion.chunk" if prep.chat else "text_completion"
        self.wants_logprobs = prep.req.params.logprobs is not None
        # The weights of the chunk's tokens (each output says which computed it); chunks without tokens
        # repeat the last one seen.
        self.fingerprint = state.weights.version

    async def write(
        self,
        resp: web.StreamResponse,
        first: tuple[int, Delta] | None,
        events: AsyncIterator[tuple[int, Delta]],
    ) -> None:
        req = self.req
        finals: dict[tuple[int, int], RequestOutput] = {}
        started: set[int] = set()
        try:
            async for i, d in _chain([first] if first is not None else [], events):
                finals[(i, d.index)] = d.output
                self.fingerprint = d.output.weight_version or self.fingerprint
                index = i * req.n + d.index
                if self.chat and index not in started:
                    started.add(index)
                    role = {
                        "index": index,
                        "delta": {"role": "assistant", "content": ""},
                        "logprobs": None,
                        "finish_reason": None,
                    }
                    await resp.write(self.chunk([role]))
                if d.text or d.finish_reason or d.echo is not None or (self.wants_logprobs and d.logprobs):
                    await resp.write(self.chunk([self.choice(index, d)]))
        except (EngineDeadError, ApiError) as exc:
            err = (
                exc if isinstance(exc, ApiError) else ApiError(500, "the engine failed", code="engine_error")
            )
            await resp.write(b"data: " + json.dumps(err.body()).encode() + b"\n\n")
        pin = pinned(req, finals)
        if req.include_usage or pin is not None:  # the last chunk: usage, and what the pin got
            await resp.write(self.chunk([], usage(self.state, finals), final=True, pin=pin))
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()

    def chunk(
        self,
        choices: list[JSONObject],
        usage: JSONObject | None = None,
        final: bool = False,
        pin: JSONObject | None = None,
    ) -> bytes:
        body: JSONObject = {
            "id": self.rid,
            "object": self.object,
            "created": self.created,
            "model": self.req.model,
            "system_fingerprint": self.fingerprint,
            "choices": choices,
        }
        if self.req.include_usage:  # as OpenAI: null on every chunk but the last
            body["usage"] = usage if final else None
        if pin is not None:
            body["pin_prefix"] = pin
        return b"data: " + json.dumps(body, separators=(",", ":")).encode() + b"\n\n"

    def choice(self, index: int, d: Delta) -> JSONObject:
        entries = d.logprobs
        text = d.text
        if self.chat:
            delta: JSONObject = {"content": text} if text else {}
            lp = chat_logprobs(entries) if self.wants_logprobs and entries else None
            return {"index": index, "delta": delta, "logprobs": lp, "finish_reason": d.finish_reason}
        if d.echo is not None:
            text = d.echo.text + text
            entries = (d.echo.logprobs or []) + (entries or [])
        lp = completion_logprobs(entries) if self.wants_logprobs and entries is not None else None
        return {"index": index, "text": text, "logprobs": lp, "finish_reason": d.finish_reason}


async def _chain(
    first: list[tuple[int, Delta]], rest: AsyncIterator[tuple[int, Delta]]
) -> AsyncIterator[tuple[int, Delta]]:
    for item in first:
        yield item
    async for item in rest:
        yield item
