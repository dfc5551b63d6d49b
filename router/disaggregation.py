"""Prefill/decode disaggregation (`kvpilot router --prefill URL... --decode URL...`): each generation request
runs in two parts, on pods that speak vLLM's `kv_transfer_params` (docs/disaggregation.md), as vllm-router's
`--vllm-pd-disaggregation` runs it:

1. **prefill**: the client's body with `max_tokens` 1, not streamed, and `kv_transfer_params` asking for a
   remote decode, to the prefill pod the policy chooses (by what it caches, as any request: proxy.decide);
   its reply's top-level `kv_transfer_params` name where the prompt's KV is held;
2. **decode**: the client's body with those params as they came, to the decode pod the decode pool's policy
   chooses (by the blocks it holds and its load), proxied back to the client as any request (streamed or
   not: proxy.proxy_to).

The decode pod is of the weight version the request may run on, and the prefill pod of the same one: KV
computed with other weights is never handed over. A prefill that fails in any way (unreachable, an error
status, silent past `--prefill-timeout`, a reply past `--max-reply-bytes` or without `kv_transfer_params`)
costs the request only its transfer: the decode goes without params and the decode pod computes the
prompt itself, never an error to the client for it. Each request's outcome is counted
(`kvpilot_router_pd_requests_total`) and every fallback logged.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable
from typing import TypeVar

import aiohttp
from aiohttp import web

from kvpilot.protocol import JSONObject
from kvpilot.protocol.kv_transfer import KV_TRANSFER, PREFILL_ASK
from kvpilot.router.app_state import ROUTER, Router
from kvpilot.router.fleet.pods import DECODE, PREFILL, Pod
from kvpilot.router.proxy import (
    UNREACHED,
    Sending,
    decide,
    no_pod,
    proxy_to,
    record_usage,
    routing_inputs,
)
from kvpilot.router.routing.prompts import INLINE_BYTES, Prompts
from kvpilot.router.routing.version_choice import pod_version
from kvpilot.serving.capped_read import read_capped

log = logging.getLogger(__name__)

# Dropped from a prefill's body: stream_options is refused on a request that does not stream, and
# min_tokens above the prefill's one token is refused too, where the decode honours both.
NOT_PREFILLED = ("stream_options", "min_tokens")

_T = TypeVar("_T")


def json_object(raw: bytes) -> JSONObject | None:
    """`raw` (a client's body, a prefill's reply) as a JSON object; None if it is none."""
    try:
        doc = json.loads(raw)
    except (ValueError, RecursionError):  # RecursionError: nested too deep
        return None
    return doc if isinstance(doc, dict) else None


def prefill_body(doc: JSONObject) -> bytes:
    """The prefill of the request `doc`: one token, not streamed, its KV held for a remote decode."""
    body = {k: v for k, v in doc.items() if k not in NOT_PREFILLED}
    body.update(max_tokens=1, stream=False)
    if "max_completion_tokens" in body:  # chat's newer name wins over max_tokens where both are set
        body["max_completion_tokens"] = 1
    body[KV_TRANSFER] = PREFILL_ASK
    return json.dumps(body).encode()


def decode_body(doc: JSONObject, params: JSONObject | None) -> bytes:
    """The decode of the request `doc`: the client's fields with the prefill's `params` as they came, or
    (None: no transfer) without any, so the decode pod computes the prompt. The router owns the field in a
    disaggregated fleet: a client's own is never passed on."""
    body = {k: v for k, v in doc.items() if k != KV_TRANSFER}
    if params is not None:
        body[KV_TRANSFER] = params
    return json.dumps(body).encode()


def transfer_params(reply: bytes) -> tuple[JSONObject | None, JSONObject | None]:
    """A prefill reply's `kv_transfer_params` (None: it has no object of that name) and its usage."""
    doc = json_object(reply)
    if doc is None:
        return None, None
    params, usage = doc.get(KV_TRANSFER), doc.get("usage")
    return (params if isinstance(params, dict) else None), (usage if isinstance(usage, dict) else None)


async def _json_work(size: int, work: Callable[..., _T], *args: object) -> _T:
    """`work(*args)` on a JSON text of `size` bytes: on the loop when small (a thread's hand-over costs
    more), else in a thread (prompts.py, INLINE_BYTES)."""
    return work(*args) if size <= INLINE_BYTES else await asyncio.to_thread(work, *args)


async def generate(request: web.Request) -> web.StreamResponse:
    r = request.app[ROUTER]
    raw = await request.read()
    prompts, pinned = await routing_inputs(r, request.path, raw)
    decoders = [p for p in r.fleet.pods if p.role == DECODE]
    ready = [p for p in decoders if p.ready]
    if not ready:
        raise no_pod()  # before any prefill: its KV would have no taker
    doc = await _json_work(len(raw), json_object, raw) if len(raw) <= r.parse_limit else None
    if doc is None:
        outcome, body = "unparsed", raw
    else:
        # The weight version the decode pod will be of (a 409 where none serves a pinned one).
        version = pod_version(r.fleet.versions.eligible(ready, pinned)[0])
        prefillers = [
            p
            for p in r.fleet.pods
            if p.role == PREFILL and p.ready and (version is None or pod_version(p) == version)
        ]
        params = None
        if prefillers:
            params, outcome = await _prefill(request, r, prefillers, prompts, doc, len(raw))
        else:
            outcome = "no_prefill_pod"
            log.warning("no prefill pod is ready%s: the decode pod computes the prompt", _of(version))
        # The client's bytes as they came where nothing changes (no params to add, none of its own to drop).
        changed = params is not None or KV_TRANSFER in doc
        body = await _json_work(len(raw), decode_body, doc, params) if changed else raw
    r.metrics.child(r.metrics.pd_requests, outcome).inc()
    return await proxy_to(request, r, decoders, r.decode_policy, prompts, pinned, body)


def _of(version: str | None) -> str:
    return "" if version is None else f" on weight version {version!r}"


async def _prefill(
    request: web.Request, r: Router, pods: list[Pod], prompts: Prompts | None, doc: JSONObject, size: int
) -> tuple[JSONObject | None, str]:
    """Prefill the request on the pod the policy chooses among `pods`; its reply's kv_transfer_params (None
    when there are none to hand over) and the outcome. The pod's usage is compared with the policy's
    prediction, as a proxied reply's is."""
    # The body first: no await between the decision and its count in flight, which the next request's
    # decision reads (a burst would otherwise all see the same rank idle).
    body = await _json_work(size, prefill_body, doc)
    decision = decide(r, pods, prompts, None)
    pod = decision.pod
    with Sending(request, r, decision) as sent:
        sent.headers["Content-Type"] = "application/json"
        try:
            async with r.session.post(
                pod.target(request.path_qs), data=body, headers=sent.headers, timeout=r.prefill_timeout
            ) as up:
                sent.status = up.status
                reply = await read_capped(up, r.settings.max_reply_bytes)
        except (aiohttp.ClientError, TimeoutError) as exc:
            # As a proxied request's failure: no more requests to the pod until its next passing probe.
            r.fleet.mark_unready(pod)
            why = type(exc).__name__
            if isinstance(exc, TimeoutError):
                why = f"no reply within {r.settings.prefill_timeout_s:g} s"
            if isinstance(exc, UNREACHED):  # a connect timeout is a TimeoutError too
                why = "unreachable"
            log.warning("prefill on %s failed (%s): the decode pod computes the prompt", pod.name, why)
            return None, "prefill_failed"
    if sent.status != 200 or reply is None:
        why = (
            f"status {sent.status}"
            if reply is not None
            else f"a reply past {r.settings.max_reply_bytes} bytes"
        )
        log.warning("prefill on %s failed (%s): the decode pod computes the prompt", pod.name, why)
        return None, "prefill_failed"
    params, usage = await _json_work(len(reply), transfer_params, reply)
    record_usage(r, decision, usage)
    if params is None:
        log.warning(
            "prefill on %s answered without kv_transfer_params (a pod without --kv-transfer-config?): the "
            "decode pod computes the prompt",
            pod.name,
        )
        return None, "no_kv_transfer_params"
    return params, "transferred"
