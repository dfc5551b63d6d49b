"""The OpenAI routes, proxied: each generation request to the pod its policy chooses, `/v1/models` to any
ready pod.

A generation request is read once (to tokenize it for the policy), then its raw body goes unchanged to
the chosen pod and the pod's reply comes back unchanged, streamed chunk by chunk for server-sent events.
A request whose body never names "stream", however escaped (`"\\u0073tream"` names it too), cannot be
streamed (OpenAI's default is false): it goes through the pods' keep-alive pool of the project's own
HTTP/1.1 client (kvpilot/fanout/http1.py), a few tens of microseconds of CPU a request against aiohttp's
ClientSession's ~70-100 (docs/performance.md, "Router");
a stream, or a body that might ask for one, goes through aiohttp's client and router/relay.py.
A client that hangs up cancels its handler, which closes the upstream connection, so the pod aborts the
request within one engine step, as if the client had called the pod directly.

What comes back from a pod is bounded: a pod silent for `--proxy-timeout` gets the client a 504 (or, once
a stream has started, an error event that ends it), a non-streamed reply longer than `--max-reply-bytes`
a 502, and any failure after the request was sent stops routing to the pod until its next passing probe.
"""

from __future__ import annotations

import json
import logging
import re
import zlib
from collections.abc import Callable, Mapping

import aiohttp
from aiohttp import web

from kvpilot.fanout.http1 import Endpoint, Reply, ReplyError, header_value_ok
from kvpilot.protocol import DP_RANK_HEADER, JSONObject
from kvpilot.protocol.errors import ApiError
from kvpilot.protocol.fields import IGNORED_FIELDS_HEADER
from kvpilot.router.app_state import ROUTER, Router
from kvpilot.router.fleet.pods import Pod
from kvpilot.router.relay import Tail, relay_stream
from kvpilot.router.routing.policy import Decision, Policy, hash_schemes
from kvpilot.router.routing.prompts import Prompts
from kvpilot.router.routing.version_choice import pinned_version
from kvpilot.serving.capped_read import read_capped

log = logging.getLogger(__name__)

FORWARD_REQUEST_HEADERS = ("Content-Type", "Accept", "Authorization")
FORWARD_RESPONSE_HEADERS = ("Content-Type", "Cache-Control", "X-Accel-Buffering", IGNORED_FIELDS_HEADER)
POD_HEADER = "X-Kvpilot-Pod"  # which pod served the request, for clients and tests


class PodUnreached(Exception):
    """No connection to the pod could be opened (the pool's OSError): the request never left."""


# The request never reached the pod (refused, or no connection within sock_connect): nothing ran there.
UNREACHED = (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError, PodUnreached)
SSE_TAIL_BYTES = 16384  # of a stream, kept for its usage event (sent last)


def no_pod() -> ApiError:
    return ApiError(503, "no pod of the fleet is ready", code="no_ready_pod")


async def generate(request: web.Request) -> web.StreamResponse:
    r = request.app[ROUTER]
    raw = await request.read()
    prompts, pinned = await routing_inputs(r, request.path, raw)
    return await proxy_to(request, r, r.fleet.pods, r.policy, prompts, pinned, raw)


async def proxy_to(
    request: web.Request,
    r: Router,
    pool: list[Pod],
    policy: Policy,
    prompts: Prompts | None,
    pinned: str | None,
    body: bytes,
) -> web.StreamResponse:
    """Send `body` to the pod of `pool` that `policy` chooses and its reply back to the client; a pod
    that cannot be reached is marked not ready and the next choice tried."""
    tried: set[str] = set()
    while True:
        pods = [p for p in pool if p.ready and p.name not in tried]
        if not pods:
            raise no_pod()
        decision = decide(r, pods, prompts, pinned, policy)
        try:
            return await _proxy(request, r, decision, body)
        except UNREACHED:
            # Never reached the pod, so nothing ran there: safe to send elsewhere.
            log.warning("%s is unreachable; trying another pod", decision.pod.name)
            r.fleet.mark_unready(decision.pod)
            tried.add(decision.pod.name)


async def routing_inputs(r: Router, path: str, raw: bytes) -> tuple[Prompts | None, str | None]:
    """What the policy routes a request to `path` with body `raw` by: its prompts, tokenized and keyed as
    the policy wants them (None: the policy routes without, or the body does not parse), and the weight
    version it pins; neither for a body over the parse limit (router/routing/prompts.py)."""
    if len(raw) > r.parse_limit:
        return None, None
    prompts = None
    if r.reader is not None and r.policy.needs_prompts and raw:
        prompts = await r.reader.prompts(path, raw, lambda: hash_schemes(r.fleet.ready_pods()))
    return prompts, pinned_version(raw)


def decide(
    r: Router, pods: list[Pod], prompts: Prompts | None, pinned: str | None, policy: Policy | None = None
) -> Decision:
    """The decision of `policy` (the router's by default) among `pods` (ready, not empty) of the weight
    version the request may run on, counted; the proxy and the endpoint picker both route with it, so both
    fill the index alike."""
    policy = policy or r.policy
    decision = policy.choose(r.fleet.versions.eligible(pods, pinned), prompts)
    m = r.metrics
    m.child(m.decisions, decision.pod.name, policy.name, decision.reason).inc()
    return decision


class Sending:
    """A request on its way to a pod, as a `with` block: counted in flight on the decided pod (and rank)
    while it runs, the policy's load charge, and in `requests_total` by the status it got (`status`; 0: no
    reply). `headers`: what it is sent with, the client's that pass and the rank's. A class, not a
    @contextmanager: the generator's machinery cost ~1 us more of every request's CPU."""

    __slots__ = ("headers", "status", "_r", "_decision", "_in_flight")

    def __init__(self, request: web.Request, r: Router, decision: Decision) -> None:
        self.headers = _forwarded(request.headers.get, FORWARD_REQUEST_HEADERS, {})
        self.status = 0
        self._r, self._decision = r, decision
        self._in_flight = r.metrics.child(r.metrics.in_flight, decision.pod.name)

    def __enter__(self) -> Sending:
        pod, rank = self._decision.pod, self._decision.rank
        if rank is not None:
            self.headers[DP_RANK_HEADER] = str(rank)
        pod.opened(rank)
        self._in_flight.set(pod.in_flight)
        return self

    def __exit__(self, *exc_info: object) -> None:
        pod = self._decision.pod
        pod.closed(self._decision.rank)
        self._in_flight.set(pod.in_flight)
        m = self._r.metrics
        m.child(m.requests, pod.name, self._r.policy.name, str(self.status)).inc()


async def _proxy(request: web.Request, r: Router, decision: Decision, raw: bytes) -> web.StreamResponse:
    pod = decision.pod
    # Usage is read (a JSON parse) only where it is compared with a prediction, and from a reply that
    # succeeded (an error reply may echo a client's body, "usage" and all).
    wants_usage = decision.predicted_cached_tokens is not None
    with Sending(request, r, decision) as sent:
        if not _may_stream(raw) and (ep := _pooled(request.path_qs, pod, sent.headers, raw)) is not None:
            return await _proxy_pooled(r, decision, ep, sent, wants_usage)
        try:
            async with r.session.post(
                pod.target(request.path_qs), data=raw, headers=sent.headers, timeout=r.proxy_timeout
            ) as up:
                sent.status = up.status
                up_headers = up.headers
                out_headers = _reply_headers(up_headers.get, decision)
                try:
                    if up_headers.get("Content-Type", "").startswith("text/event-stream"):
                        return await _relay_stream(request, r, decision, up, out_headers, wants_usage)
                    body = await read_capped(up, r.settings.max_reply_bytes)
                    if body is None:
                        raise _too_large(pod, r.settings.max_reply_bytes)
                    if wants_usage and sent.status < 300:
                        record_usage(r, decision, _json_usage(body))
                    return web.Response(body=body, status=sent.status, headers=out_headers)
                except BaseException:
                    up.close()  # drop the connection: the pod sees the client leave and aborts
                    raise
        except UNREACHED:
            raise
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise _pod_failed(r, pod, exc) from None


# "stream" as a JSON key may spell any of its letters as a \u00XX escape (the pod reads it strictly as
# UTF-8, so no other spelling names it); matched on the raw bytes, linear, never parsed here.
_STREAM_KEY = re.compile(
    rb'"(?:s|\\u0073)(?:t|\\u0074)(?:r|\\u0072)(?:e|\\u0065)(?:a|\\u0061)(?:m|\\u006[dD])"'
)


def _may_stream(raw: bytes) -> bool:
    """Whether the body might ask for a stream: it holds "stream", however escaped, anywhere (in a value
    too: such a body only takes the slower path)."""
    return b'"stream"' in raw or (b"\\u" in raw and _STREAM_KEY.search(raw) is not None)


def _pooled(path: str, pod: Pod, headers: Mapping[str, str], raw: bytes) -> Endpoint | None:
    """The request to the pod as the pool sends it (`headers`: those `sending` forwards), or None where it
    cannot be written as it came (a target or a header value that is not printable ASCII) or the pod's URL
    holds credentials: aiohttp's client sends those."""
    if not header_value_ok(path) or " " in path or "@" in pod.url:
        return None
    host, port, tls = pod.address
    netloc = f"[{host}]" if ":" in host else host
    # identity: what the pod sends back is relayed as it comes, and the client's Accept-Encoding is not
    # forwarded, so a compressed reply would reach it undeclared.
    head = f"POST {path} HTTP/1.1\r\nHost: {netloc}:{port}\r\nAccept-Encoding: identity\r\n"
    head += f"Content-Length: {len(raw)}\r\n"
    for name, value in headers.items():
        if not header_value_ok(value):
            return None
        head += f"{name}: {value}\r\n"
    return Endpoint((pod.name, host, port, tls), host, port, tls, (head + "\r\n").encode("ascii") + raw)


async def _proxy_pooled(
    r: Router, decision: Decision, ep: Endpoint, sent: Sending, wants_usage: bool
) -> web.Response:
    """`_proxy` for a request that is not streamed, through the pool: the whole reply, bounded, then to
    the client."""
    pod = decision.pod
    limit = r.settings.max_reply_bytes
    try:
        reply = await r.pool.call(ep, limit, r.settings.proxy_timeout_s)
    except TimeoutError as exc:  # before OSError: a TimeoutError is one
        raise _pod_failed(r, pod, exc) from None
    except OSError as exc:
        raise PodUnreached(str(exc)) from None
    except ReplyError as exc:
        raise _pod_failed(r, pod, exc) from None
    sent.status = reply.status
    body = _decoded(reply, limit)
    if body is None:
        raise _too_large(pod, limit)
    if wants_usage and reply.status < 300:
        record_usage(r, decision, _json_usage(body))
    out_headers = _reply_headers(lambda h: reply.headers.get(h.lower()), decision)  # (by lower-case name)
    return web.Response(body=body, status=reply.status, headers=out_headers)


def _reply_headers(get: Callable[[str], str | None], decision: Decision) -> dict[str, str]:
    """What the client's reply carries: the pod's headers that pass (read by `get`), which pod (and rank)
    served it."""
    out = _forwarded(get, FORWARD_RESPONSE_HEADERS, {POD_HEADER: decision.pod.name})
    if decision.rank is not None:
        out[DP_RANK_HEADER] = str(decision.rank)
    return out


def _too_large(pod: Pod, limit: int) -> ApiError:
    log.warning("%s sent a reply of more than %d bytes", pod.name, limit)
    return ApiError(502, f"pod {pod.name} sent a reply of more than {limit} bytes", code="reply_too_large")


def _decoded(reply: Reply, limit: int) -> bytes | None:
    """The reply's body as the client gets it, or None past `limit` bytes. A pod asked for `identity` may
    compress anyway: gzip and deflate (zlib-wrapped or raw) are inflated as aiohttp's client would (their
    Content-Encoding is not forwarded), and what they inflate to counts against the limit, not their few
    compressed bytes."""
    if not reply.complete:
        return None
    coding = reply.headers.get("content-encoding", "identity").strip().lower()
    if coding in ("", "identity"):
        return reply.body
    if coding not in ("gzip", "x-gzip", "deflate"):
        raise ApiError(502, f"the pod sent a reply in the {coding[:40]!r} coding", code="bad_gateway")
    # gzip's header, or zlib's; then a raw deflate stream (no header), which some servers send as deflate
    for wbits in (zlib.MAX_WBITS | 32,) if coding != "deflate" else (zlib.MAX_WBITS, -zlib.MAX_WBITS):
        inflate = zlib.decompressobj(wbits)
        try:
            body = inflate.decompress(reply.body, limit + 1)
        except zlib.error:
            continue
        if len(body) > limit or inflate.unconsumed_tail:
            return None
        if inflate.eof:
            return body
    raise ApiError(502, "the pod sent a compressed reply that does not inflate", code="bad_gateway")


def _forwarded(
    get: Callable[[str], str | None], names: tuple[str, ...], into: dict[str, str]
) -> dict[str, str]:
    """`into` with those of `names` that the headers `get` reads carry: only these pass between client and
    pod."""
    for h in names:
        v = get(h)
        if v is not None:
            into[h] = v
    return into


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
    tail = Tail(SSE_TAIL_BYTES) if wants_usage and up.status < 300 else None
    try:
        await relay_stream(up.content, request, resp, tail)
    except (aiohttp.ClientError, TimeoutError) as exc:
        # Headers are sent: end the stream with an error event.
        err = _pod_failed(r, decision.pod, exc)
        await resp.write(b"data: " + json.dumps(err.body()).encode() + b"\n\n")
    finally:
        # Counted however the relay ended, before the stream's end is written: openai's Python client
        # closes the response as soon as it reads [DONE], and its hang-up may cancel this handler before
        # the pod's end of stream arrives, or make writing the end raise.
        if tail is not None:
            record_usage(r, decision, _sse_usage(tail.bytes()[-SSE_TAIL_BYTES:]))
    await resp.write_eof()
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


def record_usage(r: Router, decision: Decision, usage: JSONObject | None) -> None:
    """Compare the predicted cached tokens with what the pod reported (when both are known)."""
    if decision.predicted_cached_tokens is None or not isinstance(usage, dict):
        return
    details = usage.get("prompt_tokens_details")
    reported = details.get("cached_tokens") if isinstance(details, dict) else None
    if type(reported) is not int or reported < 0:  # a counter only goes up
        return
    name, m = decision.pod.name, r.metrics
    m.child(m.predicted, name).inc(decision.predicted_cached_tokens)
    m.child(m.reported, name).inc(reported)
    if reported < decision.predicted_cached_tokens:
        m.child(m.stale, name).inc()


# A key "usage": in JSON a quote inside a string is always escaped, so `"usage"` with both its quotes bare
# and a colon after is a key, never text of a value.
_USAGE_KEY = re.compile(r'"usage"\s*:\s*')
_NEXT_MEMBER = re.compile(r"\s*([,}])\s*")
_COLON = re.compile(r"\s*:\s*")
_JSON = json.JSONDecoder()
# "usage" keys whose values are parsed before a reply's usage is given up: each costs a parse of up to the
# rest of the reply, so a reply made of them (a pod's choices may be) costs a bounded multiple of its size.
MAX_USAGE_KEYS = 8


def _json_usage(body: bytes) -> JSONObject | None:
    """The usage object of a reply: the value of its top-level "usage" key, read from that key on, not the
    whole reply parsed (its choices' text can be most of it). The daemon, vLLM and SGLang write usage after
    the choices (vLLM may add prompt logprobs after it), so it is the last "usage" key of the reply but for
    text; one nested deeper (in a choice, or in a request an error reply echoes) is not the reply's, which
    `_ends_the_reply` tells: only the top-level object's remaining members, then its end, follow it."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError:
        return None
    at, keys = text.rfind('"usage"'), 0
    while at >= 0 and keys < MAX_USAGE_KEYS:
        key = _USAGE_KEY.match(text, at)
        if key is not None and not _escaped(text, at):
            keys += 1
            try:
                usage, end = _JSON.raw_decode(text, key.end())
            except (ValueError, RecursionError):  # RecursionError: nested too deep
                return None
            if isinstance(usage, dict) and _ends_the_reply(text, end):
                return usage
        at = text.rfind('"usage"', 0, at)
    return None


def _ends_the_reply(text: str, end: int) -> bool:
    """Whether what follows a member's value (ending at `end`) closes the reply: more members ("key": value,
    each parsed), then the closing brace, then nothing. After a value nested deeper a bracket or a second
    brace comes first."""
    while True:
        sep = _NEXT_MEMBER.match(text, end)
        if sep is None:
            return False
        if sep.group(1) == "}":
            return sep.end() == len(text)
        try:
            name, end = _JSON.raw_decode(text, sep.end())
            colon = _COLON.match(text, end)
            if not isinstance(name, str) or colon is None:
                return False
            _, end = _JSON.raw_decode(text, colon.end())
        except (ValueError, RecursionError):
            return False


def _escaped(text: str, at: int) -> bool:
    """Whether the quote at `at` is escaped (an odd run of backslashes before it): inside a string, such as
    the end of a longer key."""
    start = at
    while start > 0 and text[start - 1] == "\\":
        start -= 1
    return (at - start) % 2 == 1


def _sse_usage(tail: bytes) -> JSONObject | None:
    """The usage chunk of a stream (sent last, when the client asked for stream_options.include_usage): the
    last `data: {` line that names "usage", found from the end without splitting the tail into lines."""
    at = tail.rfind(b'"usage"')
    while at >= 0:
        start = tail.rfind(b"\n", 0, at) + 1
        if tail.startswith(b"data: {", start):
            end = tail.find(b"\n", at)
            try:
                usage = json.loads(tail[start + 6 : end if end >= 0 else len(tail)]).get("usage")
            except (ValueError, RecursionError, AttributeError):
                return None
            return usage if isinstance(usage, dict) else None
        at = tail.rfind(b'"usage"', 0, start)
    return None


async def models(request: web.Request) -> web.Response:
    r = request.app[ROUTER]
    for pod in r.fleet.ready_pods():
        try:
            async with r.session.get(pod.url + "/v1/models", timeout=aiohttp.ClientTimeout(total=10)) as up:
                return web.Response(body=await up.read(), status=up.status, content_type="application/json")
        except (TimeoutError, aiohttp.ClientError):
            r.fleet.mark_unready(pod)
    raise no_pod()
