"""The OpenAI generation routes: `/v1/completions` and `/v1/chat/completions`, streaming or not.

A request goes forward through the layers once: it is parsed, templated and tokenized with each prompt's
sampling parameters (`prepare.py`, in the text pool, off the event loop), then becomes one engine request
per prompt (`EngineClient.add`), each running `best_of` (or `n`) sequences that share the prompt's KV
blocks. Tokens come back through the engine client, are detokenized and cut at stop strings
(`choices.py`, in the pool) and sent as JSON or server-sent events (`responses.py`). Whatever ends a handler early
(client gone, error) aborts its engine requests, so their blocks are freed before the next step.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid
from collections.abc import AsyncGenerator
from typing import Any, cast

from aiohttp import web

from kvpilot.daemon.engine.admission import QueueFull, RequestRejected
from kvpilot.daemon.engine.client import EngineDeadError, EngineRequest, OutputQueue
from kvpilot.daemon.engine.outputs import RequestOutput
from kvpilot.daemon.engine.request import SamplingParams
from kvpilot.daemon.server.app_state import STATE, ServerState, running_engine
from kvpilot.daemon.server.choices import (
    Delta,
    PromptEcho,
    Sequence,
    feed,
)
from kvpilot.daemon.server.detokenizer import IncrementalDetokenizer, StopStrings
from kvpilot.daemon.server.disagg import HoldReply, TransferAsk, parse_ask, pull_prefix
from kvpilot.daemon.server.prepare import (
    Prepared,
    Tokenized,
    prepare_chat,
    prepare_completion,
    prepare_tokenize,
)
from kvpilot.daemon.server.responses import complete, stream
from kvpilot.daemon.server.tenants import salt_room, tenant_of, tenant_salt
from kvpilot.protocol import DP_RANK_HEADER
from kvpilot.protocol.errors import ApiError, bad, unavailable
from kvpilot.protocol.fields import IgnoredFieldLog, ignored_fields_headers
from kvpilot.protocol.replies import json_response
from kvpilot.protocol.requests import GenerateRequest
from kvpilot.serving.admin_token import authorized, bearer_token

_IGNORED_LOG = IgnoredFieldLog()


# ---- generation ---------------------------------------------------------------------------------


async def _generate(
    state: ServerState,
    request_id: str,
    prompt: list[int],
    params: SamplingParams,
    prep: Prepared,
    prompt_text: str,
    arrival: float,
    dp_rank: int | None,
    transfer: TransferAsk | None,
) -> AsyncGenerator[Delta, None]:
    """One prompt's deltas, for all its sequences; aborts the engine request if the consumer goes
    away early or every choice ended at a stop string."""
    engine = running_engine(state)
    req = prep.req
    engine_req = EngineRequest(
        request_id,
        prompt,
        params,
        req.cache_salt,
        dp_rank,
        not req.stream,
        req.weight_version,
        req.lora_name,  # as parsed: unloaded since, it is a 404, never the base model
        req.pin_prefix,
        kv_hold=transfer.hold_id if transfer is not None else None,
    )
    if transfer is not None and transfer.remote is not None:
        remote_kv = await pull_prefix(state, engine_req, transfer.remote)
        engine_req = dataclasses.replace(engine_req, remote_kv=remote_kv)
    try:
        sink = await engine.add(engine_req)
        del engine_req  # its pulled KV, landed or not, is the engine's now: not kept for the whole decode
    except QueueFull as exc:
        raise unavailable(str(exc), "queue_full") from None
    except RequestRejected as exc:
        if exc.code == "weight_version_mismatch":
            raise ApiError(409, str(exc), "weight_version", code=exc.code) from None
        if exc.code == "model_not_found":  # an adapter unloaded since the request was parsed
            raise ApiError(404, str(exc), "model", code=exc.code) from None
        raise bad(str(exc), _param_name(exc.param, req, prep.chat), exc.code) from None
    except ValueError as exc:  # SamplingError: the client's input
        raise bad(str(exc)) from None
    tok = engine.info.tokenizer
    seqs = [_fresh_sequence(tok, prompt, req) for _ in range(params.n)]
    m = state.metrics
    engine_open = open_choices = params.n
    last = arrival
    echo = PromptEcho(prompt_text)
    try:
        while open_choices:
            items = [await _next(sink, state.settings.request_timeout, arrival)]
            while not sink.empty():
                items.append(sink.get_nowait())
            outputs = []
            for item in items:
                if isinstance(item, BaseException):  # the engine died under this request: our fault
                    raise ApiError(500, "the engine failed while running this request", code="engine_error")
                if item.restart:  # a weight swap recomputes it from the prompt: what it had is void
                    seqs[item.index] = _fresh_sequence(tok, prompt, req)
                    outputs.append(item)
                    continue
                engine_open -= item.finished
                if not seqs[item.index].done:
                    outputs.append(item)
            received = cast(list[RequestOutput], items)  # all outputs: an error among them raised above
            now = time.monotonic()
            if last == arrival:
                m.ttft.observe(now - arrival)
                m.admitted(req.lora_name, received[0].num_prompt_tokens, received[0].num_cached_tokens)
            else:
                m.itl.observe(now - last)
            last = now
            m.generation_tokens.inc(sum(len(o.new_token_ids) for o in received))
            deltas = await state.text.run(
                feed, state.token_texts, seqs, outputs, prompt, echo if req.echo else None
            )
            for d in deltas:
                if d.finish_reason is not None:
                    open_choices -= 1
                yield d
        m.e2e.observe(time.monotonic() - arrival)
    finally:
        if engine_open:
            engine.abort(request_id)  # client gone, engine failed, or stopped at a stop string


def _fresh_sequence(tok: Any, prompt: list[int], req: GenerateRequest) -> Sequence:
    return Sequence(
        IncrementalDetokenizer(tok, prompt, req.skip_special_tokens),
        StopStrings(req.stop, req.include_stop_str_in_output),
    )


async def _next(sink: OutputQueue, timeout: float | None, arrival: float) -> RequestOutput | EngineDeadError:
    if timeout is None:
        return await sink.get()
    try:
        return await asyncio.wait_for(sink.get(), max(0.0, arrival + timeout - time.monotonic()))
    except TimeoutError:
        raise ApiError(
            504,
            f"the request did not finish within {timeout:g} s (--request-timeout)",
            code="deadline_exceeded",
        ) from None


def _param_name(param: str | None, req: GenerateRequest, chat: bool) -> str | None:
    if param == "max_tokens":
        return req.max_tokens_param
    if param == "prompt" and chat:
        return "messages"
    return param


async def completions(request: web.Request) -> web.StreamResponse:
    return await _serve(request, prepare_completion, "cmpl")


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _serve(request, prepare_chat, "chatcmpl")


async def tokenize(request: web.Request) -> web.Response:
    """vLLM's `POST /tokenize`: the prompt's token ids as generation would run them (vllm-router's
    kv_aware policy asks for them to key a request's blocks)."""
    state = request.app[STATE]
    _caller_tenant(request, state)
    raw = await request.read()
    out: Tokenized = await state.text.prepare(prepare_tokenize, state.rules, raw)
    _IGNORED_LOG.note(out.ignored_fields, request.path)
    return json_response(out.body, headers=ignored_fields_headers(out.ignored_fields))


def _caller_tenant(request: web.Request, state: ServerState) -> str | None:
    """With --tenant-tokens-file, the tenant whose token the request carries (None: the admin token's
    request, trusted with the salt it names); a request with neither is a 401. Without it, None."""
    tokens = state.settings.tenant_tokens
    if tokens is None:
        return None
    header = request.headers.get("Authorization")
    presented = bearer_token(header)
    if presented is not None:
        tenant = tenant_of(presented, tokens)
        if tenant is not None:
            return tenant
        if state.settings.admin_token is not None and authorized(header, state.settings.admin_token):
            return None
    raise ApiError(
        401, "a tenant's API key is required: Authorization: Bearer <token>", code="invalid_api_key"
    )


async def _serve(request: web.Request, prepare: Any, prefix: str) -> web.StreamResponse:
    state = request.app[STATE]
    arrival = time.monotonic()
    tenant = _caller_tenant(request, state)
    dp_rank = _requested_rank(request.headers.get(DP_RANK_HEADER), running_engine(state).info.num_ranks)
    raw = await request.read()
    prep: Prepared = await state.text.prepare(prepare, state.rules, raw)
    if tenant is not None:  # the server's salt, not the body's (tenants.py)
        if prep.req.cache_salt is not None and len(prep.req.cache_salt) > (room := salt_room(tenant)):
            raise bad(f"'cache_salt' may hold at most {room} characters for tenant {tenant}", "cache_salt")
        prep.req.cache_salt = tenant_salt(tenant, prep.req.cache_salt)
        if prep.req.pin_prefix:  # pins share one cap: a tenant could hold it all (docs/security.md)
            prep.req.pin_prefix, prep.req.pin_refused = False, "tenant"
    _IGNORED_LOG.note(prep.req.ignored_fields, request.path)
    max_blocks = state.engine.info.max_model_len // state.engine.info.block_size
    transfer = parse_ask(
        prep.req, state.engine.kv_connector, len(prep.prompts), max_blocks, state.transfer_key
    )
    rid = f"{prefix}-{uuid.uuid4().hex}"
    ids = [rid if len(prep.prompts) == 1 else f"{rid}-{i}" for i in range(len(prep.prompts))]
    gens = [
        _generate(state, ids[i], p, prep.params[i], prep, prep.prompt_texts[i], arrival, dp_rank, transfer)
        for i, p in enumerate(prep.prompts)
    ]
    if prep.req.stream:
        return await stream(request, state, prep, rid, gens)
    held = None
    if transfer is not None and transfer.hold_id is not None:
        held = HoldReply(transfer.hold_id, request.url.host or _reached_address(request))
    return await complete(state, prep, rid, gens, held)


def _reached_address(request: web.Request) -> str:
    """The address this connection reached (a request without a Host header)."""
    sock = request.transport.get_extra_info("sockname") if request.transport is not None else None
    return str(sock[0]) if isinstance(sock, tuple) else "localhost"


def _requested_rank(value: str | None, num_ranks: int) -> int | None:
    """The rank a router asked for, checked: a request must not land on a rank that does not exist."""
    if value is None:
        return None
    try:
        rank = int(value.strip())
    except ValueError:
        rank = -1
    if not 0 <= rank < num_ranks:
        raise bad(
            f"{DP_RANK_HEADER} must be an integer from 0 to {num_ranks - 1}, got {value!r}", DP_RANK_HEADER
        )
    return rank
