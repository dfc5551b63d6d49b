"""The endpoint picker: Envoy's external processing service (`envoy.service.ext_proc.v3.ExternalProcessor`)
as the Gateway API Inference Extension's endpoint picker protocol (EPP) asks, so a gateway routes with the
router's own pods, tokenizer, policy and prefix index (`kvpilot router --endpoint-picker-port PORT`).

One gRPC stream per HTTP request. The gateway sends the request's headers, then its body: all at once
(request_body_mode BUFFERED: the headers are answered at once, the pick rides on the body's answer) or in
chunks (FULL_DUPLEX_STREAMED: nothing is answered until the last chunk, then the headers' answer carries the
pick and the body goes back in one piece, as the gateway waits for the processor to send it). The pick is
the proxy's (proxy.decide: the same prompts, weight-version choice and policy, which records the blocks
it expects on that pod exactly as for a proxied request), answered as the header
`x-gateway-destination-endpoint: IP:PORT[,IP:PORT...]` (fallbacks after the pick) and the same value in
the dynamic metadata namespace `envoy.lb`; where the policy chose a rank of a data-parallel pod, the
header `X-data-parallel-rank` too, as the proxy sends it, and only pods with that rank as fallbacks. A
subset hint (`envoy.lb.subset_hint`) limits the pick to the pods it names. What cannot be picked is
answered with an ImmediateResponse in OpenAI's error shape: 503 without a ready pod, 400 for a body that
is not a JSON object or a message that is no ext_proc message, 413 past the body cap, 408 past the
stream's deadline, 503 when the bodies all streams hold would pass `--endpoint-picker-buffer-bytes`. The
proxy sheds no load, so neither does the picker (no 429).

The pod (and rank) counts the request as in flight (as the proxy does, for the policy's load charge)
until the gateway closes the stream, which Envoy does when the HTTP request ends, or for
`--endpoint-picker-hold` at most, when the picker closes it. Any later message of the stream (response
headers, bodies, trailers, when the gateway sends them) is answered unchanged.

grpc and Envoy's generated messages are imported only here, when the picker is on."""

from __future__ import annotations

import asyncio
import ipaddress
import json
import logging
from dataclasses import dataclass

import grpc
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from envoy.type.v3 import http_status_pb2
from google.protobuf import struct_pb2
from google.protobuf.message import DecodeError
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from kvpilot.protocol import DP_RANK_HEADER
from kvpilot.protocol.errors import ApiError, bad
from kvpilot.router.app_state import Router
from kvpilot.router.fleet.pods import Pod
from kvpilot.router.proxy import decide, routing_inputs
from kvpilot.router.routing.policy import Decision

log = logging.getLogger(__name__)

DESTINATION = "x-gateway-destination-endpoint"
DESTINATION_NAMESPACE = "envoy.lb"
SUBSET = "x-gateway-destination-endpoint-subset"
SUBSET_NAMESPACE = "envoy.lb.subset_hint"
SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
# What one gRPC message may hold beyond a body of max_body_bytes: headers, metadata, framing.
MESSAGE_SLACK_BYTES = 256 << 10
FULL_DUPLEX = processing_mode_pb2.ProcessingMode.FULL_DUPLEX_STREAMED
BUFFERED = processing_mode_pb2.ProcessingMode.BUFFERED
OVERWRITE = base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD


def fallbacks(pods: list[Pod], decision: Decision, most: int) -> list[Pod]:
    """Up to `most` pods a gateway may try after the one decided, least loaded first. A rank named goes to
    every endpoint the gateway tries, so they are pods with that rank (a pod answers 400 for a rank it
    lacks; one whose ranks are not known yet has rank 0 at least)."""
    rank = decision.rank

    def has_rank(p: Pod) -> bool:
        return rank is None or rank in p.ranks or (rank == 0 and not p.ranks)

    return sorted((p for p in pods if p is not decision.pod and has_rank(p)), key=Pod.load)[:most]


def endpoint(pod: Pod) -> str:
    """The pod as the gateway names it: IP:PORT ([IP]:PORT for IPv6)."""
    host = pod.host
    try:
        if ipaddress.ip_address(host).version == 6:
            host = f"[{host}]"
    except ValueError:  # a host name (a static --endpoints entry): passed as written
        pass
    return f"{host}:{pod.port}"


@dataclass(frozen=True, slots=True)
class _Malformed:
    """What the gRPC deserializer hands on for bytes that are no ProcessingRequest (grpc would log a
    traceback for each one it cannot parse itself)."""

    why: str


def _parse(raw: bytes) -> ep.ProcessingRequest | _Malformed:
    try:
        return ep.ProcessingRequest.FromString(raw)
    except DecodeError as exc:
        return _Malformed(str(exc)[:200])


@dataclass(slots=True)
class _Request:
    """What the stream has told so far of one HTTP request."""

    path: str = ""
    headers: bool = False  # the request's headers came (a second set is refused: its body is counted)
    body: bytearray | None = None  # None: no body (headers ended the request)
    full_duplex: bool = False
    trailers: bool = False  # the body was ended by trailers (FULL_DUPLEX_STREAMED), still to be answered
    subset: frozenset[str] | None = None  # None: no hint, any pod of the fleet


class EndpointPicker:
    def __init__(self, router: Router) -> None:
        self.r = router
        self.max_body = router.settings.max_body_bytes
        self.buffer_left = router.settings.endpoint_picker_buffer_bytes  # over all streams' bodies
        self.max_streams = router.settings.endpoint_picker_max_streams  # over all gateway connections
        self.streams = 0

    async def Process(self, request_iterator: object, context: grpc.aio.ServicerContext) -> None:  # noqa: N802 - gRPC's name
        m = self.r.metrics
        if self.streams >= self.max_streams:  # gRPC's own cap would refuse health checks too
            m.child(m.picker_requests, "busy").inc()
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"the endpoint picker has {self.streams} streams open (--endpoint-picker-max-streams)",
            )
        self.streams += 1
        picked: Decision | None = None
        req = _Request()
        try:
            try:
                async with asyncio.timeout(self.r.settings.endpoint_picker_timeout_s):
                    if not await self._read_request(context, req):  # the gateway went away first
                        return
                    picked, replies = await self._pick(req)
            except TimeoutError:
                s = self.r.settings.endpoint_picker_timeout_s
                err = ApiError(408, f"the request was not received within {s:g} s", code="request_timeout")
                replies = [_immediate(err)]
            except ApiError as err:
                replies = [_immediate(err)]
            result = "picked" if picked is not None else _result(replies[0])
            m.child(m.picker_requests, result).inc()
            try:
                # The writes too: a gateway that reads nothing (no HTTP/2 window) must not hold them for good.
                async with asyncio.timeout(self.r.settings.endpoint_picker_hold_s):
                    for reply in replies:
                        await context.write(reply)
                    del replies  # a streamed body's copy goes with them; then its bytes are counted free
                    self._release(req)
                    if picked is not None:
                        await self._answer_the_rest(context)
            except TimeoutError:  # the stream ends here; the gateway's request goes on unprocessed
                log.info("endpoint picker: a stream held past --endpoint-picker-hold, closed")
        finally:
            self.streams -= 1
            self._release(req)
            if picked is not None:
                picked.pod.closed(picked.rank)
                m.child(m.in_flight, picked.pod.name).set(picked.pod.in_flight)

    def _release(self, req: _Request) -> None:
        """The request's body no longer counts against the buffer."""
        if req.body is not None:
            self._buffer(-len(req.body))
            req.body = None

    def _buffer(self, n: int) -> None:
        """`n` more bytes of bodies held (negative: given back), as the gauge shows."""
        self.buffer_left -= n
        self.r.metrics.picker_buffered.set(self.r.settings.endpoint_picker_buffer_bytes - self.buffer_left)

    async def _read_request(self, context: grpc.aio.ServicerContext, req: _Request) -> bool:
        """Read the request's headers and whole body into `req` (answering the headers at once in BUFFERED
        mode); False when the gateway closed the stream first."""
        while True:
            msg = await context.read()
            if msg is grpc.aio.EOF:
                return False
            if isinstance(msg, _Malformed):
                log.warning("endpoint picker: a message that is no ext_proc request (%s)", msg.why)
                raise bad(
                    "the stream sent a message that is no ext_proc ProcessingRequest", code="bad_stream"
                )
            kind = msg.WhichOneof("request")
            if kind == "request_headers":
                if req.headers:
                    raise bad("ext_proc message request_headers twice in one stream", code="bad_stream")
                req.headers = True
                if msg.HasField("protocol_config"):
                    mode = msg.protocol_config.request_body_mode
                    if mode not in (BUFFERED, FULL_DUPLEX, processing_mode_pb2.ProcessingMode.NONE):
                        modes = processing_mode_pb2.ProcessingMode.BodySendMode
                        name = (
                            modes.Name(mode) if mode in modes.values() else f"in mode {mode}"
                        )  # (a newer one)
                        raise ApiError(
                            500,
                            f"the gateway sends bodies {name}; the endpoint picker reads BUFFERED or "
                            "FULL_DUPLEX_STREAMED",
                            code="unsupported_body_mode",
                        )
                    req.full_duplex = mode == FULL_DUPLEX
                req.subset = _subset(msg.metadata_context)
                req.path = _header(msg.request_headers.headers, ":path").partition("?")[0]
                if msg.request_headers.end_of_stream:
                    return True
                req.body = bytearray()
                if not req.full_duplex:  # the body comes once the headers are answered
                    await context.write(ep.ProcessingResponse(request_headers=ep.HeadersResponse()))
            elif kind == "request_body" and req.body is not None:
                chunk = msg.request_body.body
                if len(req.body) + len(chunk) > self.max_body:
                    raise ApiError(
                        413, f"the request body exceeds {self.max_body} bytes", code="request_too_large"
                    )
                if len(chunk) > self.buffer_left:
                    raise ApiError(
                        503,
                        "the endpoint picker holds as many request bodies as it may; retry",
                        code="picker_busy",
                        headers={"Retry-After": "1"},
                    )
                self._buffer(len(chunk))
                req.body += chunk
                # BUFFERED: one message holds the whole body (trailers, if any, come after its answer)
                if msg.request_body.end_of_stream or not req.full_duplex:
                    return True
            elif kind == "request_trailers" and req.body is not None and req.full_duplex:
                req.trailers = True  # they end the body
                return True
            else:
                raise bad(f"ext_proc message {kind} before the request's headers and body", code="bad_stream")

    async def _pick(self, req: _Request) -> tuple[Decision, list[ep.ProcessingResponse]]:
        r = self.r
        raw = bytes(req.body or b"")
        pods = [p for p in r.fleet.pods if p.ready and (req.subset is None or endpoint(p) in req.subset)]
        if not pods:
            where = "of the subset the gateway named " if req.subset is not None else ""
            raise ApiError(503, f"no pod {where}is ready", code="no_ready_pod")
        prompts, pinned = await routing_inputs(r, req.path, raw)
        if (
            prompts is None
            and raw
            and len(raw) <= r.parse_limit
            and not await asyncio.to_thread(_is_json_object, raw)
        ):
            raise bad("the request body is not a JSON object", code="invalid_json")
        decision = decide(r, pods, prompts, pinned)
        pod, rank = decision.pod, decision.rank
        value = ",".join(
            endpoint(p) for p in [pod, *fallbacks(pods, decision, r.settings.endpoint_picker_fallbacks)]
        )
        pod.opened(rank)
        r.metrics.child(r.metrics.in_flight, pod.name).set(pod.in_flight)
        log.debug("picked %s rank %s (%s) for %s", value, rank, decision.reason, req.path)
        headers = {DESTINATION: value}
        if rank is not None:  # the rank the policy scored, as the proxy sends it (vLLM's header)
            headers[DP_RANK_HEADER] = str(rank)
        mutation = ep.CommonResponse(
            header_mutation=ep.HeaderMutation(
                set_headers=[
                    base_pb2.HeaderValueOption(
                        header=base_pb2.HeaderValue(key=k, raw_value=v.encode()), append_action=OVERWRITE
                    )
                    for k, v in headers.items()
                ],
                # else a client's own would pass (the proxy forwards none): the rank is the router's choice
                remove_headers=[] if rank is not None else [DP_RANK_HEADER],
            )
        )
        metadata = struct_pb2.Struct()
        metadata.update({DESTINATION_NAMESPACE: {DESTINATION: value}})
        if req.body is None:  # headers only: they carry the pick
            return decision, [
                ep.ProcessingResponse(
                    request_headers=ep.HeadersResponse(response=mutation), dynamic_metadata=metadata
                )
            ]
        if not req.full_duplex:  # BUFFERED: the headers wait upstream for the body's answer, which sets them
            return decision, [
                ep.ProcessingResponse(
                    request_body=ep.BodyResponse(response=mutation), dynamic_metadata=metadata
                )
            ]
        # FULL_DUPLEX_STREAMED: the held headers' answer, then the body, unchanged, from the processor.
        body = ep.CommonResponse(
            body_mutation=ep.BodyMutation(
                streamed_response=ep.StreamedBodyResponse(body=raw, end_of_stream=not req.trailers)
            )
        )
        replies = [
            ep.ProcessingResponse(
                request_headers=ep.HeadersResponse(response=mutation), dynamic_metadata=metadata
            ),
            ep.ProcessingResponse(request_body=ep.BodyResponse(response=body)),
        ]
        if req.trailers:  # passed on unchanged, after the body
            replies.append(ep.ProcessingResponse(request_trailers=ep.TrailersResponse()))
        return decision, replies

    async def _answer_the_rest(self, context: grpc.aio.ServicerContext) -> None:
        """Until the gateway closes the stream: whatever else it sends goes on unchanged."""
        while (msg := await context.read()) is not grpc.aio.EOF:
            if isinstance(msg, _Malformed):
                log.warning(
                    "endpoint picker: a message that is no ext_proc request (%s); stream closed", msg.why
                )
                return
            kind = msg.WhichOneof("request")
            if kind in ("request_headers", "response_headers"):
                await context.write(ep.ProcessingResponse(**{kind: ep.HeadersResponse()}))
            elif kind in ("request_body", "response_body"):
                await context.write(ep.ProcessingResponse(**{kind: ep.BodyResponse()}))
            elif kind in ("request_trailers", "response_trailers"):
                await context.write(ep.ProcessingResponse(**{kind: ep.TrailersResponse()}))


def _header(headers: base_pb2.HeaderMap, name: str) -> str:
    for h in headers.headers:
        if h.key == name:
            value: str = h.raw_value.decode("latin-1") if h.raw_value else h.value  # protobuf's Any: no stubs
            return value
    return ""


def _subset(metadata: base_pb2.Metadata) -> frozenset[str] | None:
    """The endpoints of the gateway's subset hint; None without one."""
    if SUBSET_NAMESPACE not in metadata.filter_metadata:
        return None
    fields = metadata.filter_metadata[SUBSET_NAMESPACE].fields
    if SUBSET not in fields:
        return None
    return frozenset(v.string_value for v in fields[SUBSET].list_value.values)


def _is_json_object(raw: bytes) -> bool:
    try:
        return isinstance(json.loads(raw), dict)
    except (ValueError, RecursionError):
        return False


def _immediate(err: ApiError) -> ep.ProcessingResponse:
    """`err` answered by the gateway itself, in OpenAI's error shape."""
    headers = [("content-type", "application/json"), *((k.lower(), v) for k, v in err.headers.items())]
    return ep.ProcessingResponse(
        immediate_response=ep.ImmediateResponse(
            status=http_status_pb2.HttpStatus(code=err.status),
            headers=ep.HeaderMutation(
                set_headers=[
                    base_pb2.HeaderValueOption(header=base_pb2.HeaderValue(key=k, raw_value=v.encode()))
                    for k, v in headers
                ]
            ),
            body=json.dumps(err.body()).encode() + b"\n",
            details=err.code or "",
        )
    )


def _result(reply: ep.ProcessingResponse) -> str:
    """The metrics' `result` label of an immediate reply."""
    return {
        400: "bad_request",
        408: "timeout",
        409: "bad_request",
        413: "too_large",
        503: "busy" if reply.immediate_response.details == "picker_busy" else "no_ready_pod",
    }.get(reply.immediate_response.status.code, "error")


async def start(router: Router, host: str, port: int) -> grpc.aio.Server:
    """The picker and gRPC health on host:port, started."""
    limit = router.settings.max_body_bytes + MESSAGE_SLACK_BYTES
    streams = router.settings.endpoint_picker_max_streams
    server = grpc.aio.server(
        options=[
            ("grpc.max_receive_message_length", limit),
            ("grpc.max_send_message_length", limit),
            # Per connection, a few above the picker's own cap over all of them, so a stream past that cap is
            # refused rather than held back by HTTP/2, and health checks still find a slot.
            ("grpc.max_concurrent_streams", streams + 8),
        ]
    )
    process = grpc.stream_stream_rpc_method_handler(
        EndpointPicker(router).Process,
        request_deserializer=_parse,
        response_serializer=ep.ProcessingResponse.SerializeToString,
    )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, {"Process": process}),))
    checks = health.aio.HealthServicer()
    # GAIE's EPP names liveness, readiness and the ext_proc service; "" is gRPC's whole-server check. One
    # router serves them all (no leader election), from its start.
    for name in ("", "liveness", "readiness", SERVICE):
        await checks.set(name, health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(checks, server)
    where = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    if server.add_insecure_port(where) == 0:
        raise OSError(f"cannot listen on {where}")
    await server.start()
    return server
