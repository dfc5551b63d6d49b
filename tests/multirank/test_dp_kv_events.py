"""Every rank of a `--data-parallel-size 2` daemon routed exactly: each rank publishes its own KV events
(port + rank, read here with a real ZeroMQ SUB per rank), `X-data-parallel-rank` sends a request to the
rank named, and the prefix-aware router in front of it (and of a single-rank daemon) sends a repeated
prompt to the same (pod, rank), which then reports the prompt as cached; its endpoint picker names the
rank to a gateway as well, and a real Envoy sends the request on with it."""

from __future__ import annotations

import json

import grpc
import msgpack
import pytest
import zmq
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc

from kvpilot.daemon.engine.config import EngineConfig
from kvpilot.daemon.engine.kv.publisher import rank_endpoint
from support.endpoint_picker import picked
from support.envoy import post, running_envoy
from support.procs import free_port, free_port_run, wait_for
from support.servers import Server, start_daemon, start_router, start_server, stop_fleet, stop_router

pytestmark = pytest.mark.timeout(600)

PROMPT = "Every rank keeps its own cache, so a router must know which rank holds a prefix. " * 3
ASK = {"model": "SmolLM2-135M-Instruct", "prompt": PROMPT, "max_tokens": 2, "temperature": 0}


@pytest.fixture(scope="module")
def dp_daemon(tmp_path_factory: pytest.TempPathFactory) -> Server:
    tmp = tmp_path_factory.mktemp("dpkv")
    # Both sockets of both ranks in one run of ports: rank 1 publishes on pub + 1, so a replay port drawn
    # on its own could land there.
    pub = free_port_run(4)
    replay = pub + 2
    srv = start_server(
        tmp,
        "--data-parallel-size",
        "2",
        "--kv-events-endpoint",
        f"tcp://127.0.0.1:{pub}",
        "--kv-events-replay-endpoint",
        f"tcp://127.0.0.1:{replay}",
        token="t",
    )
    srv.ports = (pub, replay)
    yield srv
    stop_fleet(None, [srv])


def test_rank_endpoints_are_port_plus_rank() -> None:
    assert rank_endpoint("tcp://0.0.0.0:5557", 0) == "tcp://0.0.0.0:5557"
    assert rank_endpoint("tcp://[::1]:5557", 3) == "tcp://[::1]:5560"
    assert rank_endpoint("tcp://127.0.0.1:0", 1) == "tcp://127.0.0.1:0"  # any free port: /kv_events names it
    two = dict(data_parallel_size=2, kv_events_endpoint="tcp://127.0.0.1:5557")
    EngineConfig(**two, kv_events_replay_endpoint="tcp://127.0.0.1:5559").validate()
    with pytest.raises(ValueError, match="overlap"):  # rank 1's events would take rank 0's replay port
        EngineConfig(**two, kv_events_replay_endpoint="tcp://127.0.0.1:5558").validate()


def test_each_rank_publishes_its_own_events_and_the_header_picks_the_rank(dp_daemon: Server) -> None:
    pub, replay = dp_daemon.ports
    where = dp_daemon.request("GET", "/kv_events").json()
    assert [(r["rank"], r["endpoint"], r["replay_endpoint"]) for r in where["ranks"]] == [
        (r, f"tcp://127.0.0.1:{pub + r}", f"tcp://127.0.0.1:{replay + r}") for r in (0, 1)
    ]
    assert (where["endpoint"], where["replay_endpoint"]) == (
        where["ranks"][0]["endpoint"],
        where["ranks"][0]["replay_endpoint"],
    )
    ctx = zmq.Context()
    subs = []
    for r in where["ranks"]:
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(r["endpoint"])
        subs.append(sub)
    try:
        # A SUB misses what is sent before it joined: send until rank 1's events come through.
        def rank1_event() -> list:
            reply = dp_daemon.request("POST", "/v1/completions", ASK, headers={"X-data-parallel-rank": "1"})
            assert reply.status == 200, reply.body
            return subs[1].poll(2000) and subs[1].recv_multipart()

        topic, seq, payload = wait_for(rank1_event, 60, "a KV event batch from rank 1")
        ts, events, rank = msgpack.unpackb(payload)
        assert rank == 1 and events[0]["type"] == "BlockStored"
        assert subs[0].poll(500) == 0  # rank 0 ran nothing, so it published nothing
        again = dp_daemon.request(
            "POST", "/v1/completions", ASK, headers={"X-data-parallel-rank": "1"}
        ).json()
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    finally:
        for s in subs:
            s.close(linger=0)
        ctx.term()
    ranks = dp_daemon.cache()["ranks"]
    assert ranks[0]["query_tokens"] == 0 and ranks[1]["query_tokens"] > 0  # the header was honoured
    for bad in ("2", "-1", "one"):
        reply = dp_daemon.request("POST", "/v1/completions", ASK, headers={"X-data-parallel-rank": bad})
        assert reply.status == 400 and "X-data-parallel-rank" in reply.json()["error"]["message"], reply.body


def test_the_router_sends_a_repeated_prompt_to_the_same_pod_rank(dp_daemon: Server, tmp_path) -> None:  # noqa: ANN001
    single = start_daemon(tmp_path, token="t")
    router = None
    try:
        # Without data parallelism only rank 0 exists.
        assert (
            single.request("POST", "/v1/completions", ASK, headers={"X-data-parallel-rank": "0"}).status
            == 200
        )
        assert (
            single.request("POST", "/v1/completions", ASK, headers={"X-data-parallel-rank": "1"}).status
            == 400
        )
        router = start_router(tmp_path, [dp_daemon.url, single.url], token="t")
        assert {p["pod"]: p["ranks"] for p in router.health()["pods"]} == {
            f"127.0.0.1:{dp_daemon.port}": 2,
            f"127.0.0.1:{single.port}": 1,
        }
        served = {}
        for topic in ("rivers", "planets"):  # round robin among equals: the second lands on the other pod
            prompt = f"A prompt about {topic} only this test sends, long enough for a few cache blocks. " * 3
            before = {p["pod"]: p["indexed_blocks"] for p in router.health()["pods"]}
            first = router.request("POST", "/v1/completions", {**ASK, "prompt": prompt})
            assert first.status == 200, first.body
            pod, rank = first.headers["X-Kvpilot-Pod"], first.headers.get("X-data-parallel-rank")
            indexed = before[pod]
            wait_for(lambda: router.pod(pod)["indexed_blocks"] > indexed, 30, "the request's blocks indexed")  # noqa: B023
            for _ in range(2):
                again = router.request("POST", "/v1/completions", {**ASK, "prompt": prompt})
                assert (again.headers["X-Kvpilot-Pod"], again.headers.get("X-data-parallel-rank")) == (
                    pod,
                    rank,
                )
                assert again.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
            served[pod] = rank
        # The DP pod got a rank named; the single-rank pod gets no header.
        assert served == {
            f"127.0.0.1:{dp_daemon.port}": served[f"127.0.0.1:{dp_daemon.port}"],
            f"127.0.0.1:{single.port}": None,
        }
        assert served[f"127.0.0.1:{dp_daemon.port}"] in ("0", "1")
    finally:
        stop_fleet(router, [single])


def test_the_endpoint_picker_names_the_rank_it_chose(dp_daemon: Server, tmp_path) -> None:  # noqa: ANN001
    """A gateway in front of the data-parallel daemon is told the rank as well as the pod: sent there, a
    prompt is cached on that rank, and the picker sends the same prompt to the same rank again."""
    port = free_port()
    router = start_router(tmp_path, [dp_daemon.url], "--endpoint-picker-port", str(port), token="t")
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    stub = ep_grpc.ExternalProcessorStub(channel)
    prompt = "A prompt the endpoint picker places on one rank of the two, long enough for blocks. " * 3
    body = json.dumps({**ASK, "prompt": prompt}).encode()

    def pick() -> dict[str, str]:
        mutation = picked(stub, "/v1/completions", body)
        assert not mutation.remove_headers  # the rank header is set, not removed
        return {h.header.key: h.header.raw_value.decode() for h in mutation.set_headers}

    try:
        first = pick()
        assert first["x-gateway-destination-endpoint"] == f"127.0.0.1:{dp_daemon.port}", first
        rank = first["X-data-parallel-rank"]
        assert rank in ("0", "1")
        for _ in range(2):  # as the gateway sends it: the rank's own cache serves the second
            reply = dp_daemon.request(
                "POST", "/v1/completions", ASK | {"prompt": prompt}, headers={"X-data-parallel-rank": rank}
            )
            assert reply.status == 200, reply.body
        assert reply.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        assert pick()["X-data-parallel-rank"] == rank
    finally:
        channel.close()
        stop_router(router)


def test_through_envoy_a_request_runs_on_the_rank_the_picker_named(dp_daemon: Server, tmp_path) -> None:  # noqa: ANN001
    """Envoy applies the picker's rank over the client's own: a rank the pod does not have, which it refuses
    when sent directly (400), is replaced on the way, and the prompt sent again is served from the cache of
    the rank it went to."""
    picker_port = free_port()
    router = start_router(tmp_path, [dp_daemon.url], "--endpoint-picker-port", str(picker_port), token="t")
    ask = ASK | {"prompt": "A prompt sent through a gateway to one rank of a data-parallel pod, twice. " * 3}
    bogus = {"X-data-parallel-rank": "9"}
    try:
        refused = dp_daemon.request("POST", "/v1/completions", ask, headers=bogus)
        assert refused.status == 400, refused.body
        with running_envoy(tmp_path, picker_port) as listen:
            replies = []
            for _ in range(2):
                status, headers, reply = post(listen, "/v1/completions", ask, bogus)
                assert status == 200, reply
                assert headers["x-upstream-host"] == f"127.0.0.1:{dp_daemon.port}", headers
                replies.append(reply)
        assert replies[0]["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert replies[1]["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    finally:
        stop_router(router)
