"""Router CPU cost: kvpilot's router against the real `sglang-router` (PyPI), on the same stub workers.

`--workers` stub workers (2 by default; this file run with --worker: a raw asyncio HTTP/1.1 server,
keep-alive, up to 8 ports in one process) answer OpenAI
chat completions at once: a JSON reply with usage, or, for `"stream": true`, `--chunks` server-sent
events sent one per write a little apart (as an engine emits tokens), then the usage event and [DONE].
Each router in turn fronts all of them, round-robin (`kvpilot router --policy round-robin`, `sglang-router
launch --policy round_robin`), and gets the same load from this process: N chats at concurrency C, then
S streams of K chunks. What a router costs is the CPU seconds of its process over each phase (its
CPU-time clock, benchkit.cpu_s: all its threads): CPU per chat, and per streamed chunk (a
stream's CPU over its chunks). The routers run one after the other, `--repeats` times alternating, on
the same machine state; the load average is written beside the figures.

    .venv/bin/python bench/router_cost.py                      # 1500 chats at 32; 120 streams of 64
    .venv/bin/python bench/router_cost.py --chats 300 --streams 20 --repeats 1   # a quick look

`sglang-router` comes from `make sglang-router` (~/.cache/kvpilot/tools/bin). Results go to
bench/results/router-cost-<UTC time>.json (--out to choose).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import aiohttp

sys.path.append(str(Path(__file__).resolve().parents[1] / "hack" / "lib"))  # benchkit, devcluster

import benchkit
from devcluster.procs import free_port

ROOT = Path(__file__).resolve().parent.parent
MODEL = "stub"


# ---- the stub worker -----------------------------------------------------------------------------
def _chat_reply() -> bytes:
    usage = {"prompt_tokens": 12, "completion_tokens": 4, "total_tokens": 16}
    usage["prompt_tokens_details"] = {"cached_tokens": 0}
    doc = {
        "id": "chatcmpl-stub",
        "object": "chat.completion",
        "created": 0,
        "model": MODEL,
        "choices": [
            {"index": 0, "message": {"role": "assistant", "content": "Hi there!"}, "finish_reason": "stop"}
        ],
        "usage": usage,
    }
    return json.dumps(doc).encode()


def _event(doc: dict) -> bytes:
    return b"data: " + json.dumps(doc).encode() + b"\n\n"


async def _serve_worker(ports: list[int], gap_s: float, chunks: int) -> None:
    reply = _chat_reply()
    delta = _event(
        {
            "id": "chatcmpl-stub",
            "object": "chat.completion.chunk",
            "model": MODEL,
            "choices": [{"index": 0, "delta": {"content": " tok"}, "finish_reason": None}],
        }
    )
    usage = {"prompt_tokens": 12, "completion_tokens": 0, "prompt_tokens_details": {"cached_tokens": 0}}

    def chunk(data: bytes) -> bytes:
        return b"%x\r\n%s\r\n" % (len(data), data)

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                lines = head.decode("latin-1").split("\r\n")
                method, path, _ = lines[0].split(" ", 2)
                length = 0
                for line in lines[1:]:
                    if line[:15].lower() == "content-length:":
                        length = int(line[15:])
                body = await reader.readexactly(length) if length else b""
                if method == "POST" and path.startswith("/v1/chat/completions"):
                    req = json.loads(body)
                    if req.get("stream"):
                        writer.write(
                            b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                            b"Cache-Control: no-cache\r\nTransfer-Encoding: chunked\r\n\r\n"
                        )
                        n = chunks  # not the body's max_tokens: sglang-router rewrites that field
                        for _ in range(n):
                            writer.write(chunk(delta))
                            await writer.drain()
                            await asyncio.sleep(gap_s)
                        done = {"id": "chatcmpl-stub", "object": "chat.completion.chunk", "model": MODEL}
                        done |= {"choices": [], "usage": {**usage, "completion_tokens": n}}
                        writer.write(chunk(_event(done) + b"data: [DONE]\n\n") + b"0\r\n\r\n")
                        await writer.drain()
                        continue
                    status, out = b"200 OK", reply
                elif method == "GET" and path.startswith("/kv_events"):
                    status, out = b"404 Not Found", b'{"error": "no kv events"}'
                elif method == "GET" and path.startswith("/v1/models"):
                    status, out = (
                        b"200 OK",
                        b'{"object": "list", "data": [{"id": "stub", "object": "model"}]}',
                    )
                else:  # /health, /health_generate, /get_model_info, /get_server_info, ...
                    status, out = b"200 OK", b'{"status": "ok", "model_path": "stub"}'
                writer.write(
                    b"HTTP/1.1 %s\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                    % (status, len(out), out)
                )
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError, ValueError):
            pass
        finally:
            writer.close()

    servers = [await asyncio.start_server(handle, "127.0.0.1", p, backlog=1024) for p in ports]
    await asyncio.gather(*(s.serve_forever() for s in servers))


# ---- processes -----------------------------------------------------------------------------------
def _ready_json(url: str, path: str, check) -> bool:
    with urllib.request.urlopen(url + path, timeout=5) as r:
        return check(json.loads(r.read()))


def start_kvpilot(workers: list[str], tmp: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    argv = [sys.executable, "-m", "kvpilot", "router", "--policy", "round-robin"]
    argv += ["--host", "127.0.0.1", "--port", str(port), "--endpoints", ",".join(workers)]

    def ready(health: dict) -> bool:
        return sum(bool(p.get("ready")) for p in health.get("pods", [])) == len(workers)

    return benchkit.launch(argv, tmp / "kvpilot-router.log", url, 120, ready=ready), url


def start_sglang(binary: str, workers: list[str], tmp: Path) -> tuple[subprocess.Popen, str]:
    from devcluster.procs import spawn, wait_ready

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    argv = [binary, "launch", "--host", "127.0.0.1", "--port", str(port), "--worker-urls", *workers]
    argv += [
        "--policy",
        "round_robin",
        "--prometheus-host",
        "127.0.0.1",
        "--prometheus-port",
        str(free_port()),
    ]
    log = tmp / "sglang-router.log"
    proc = spawn(argv, log_path=log, cwd=tmp)  # outside the checkout, as a user runs it
    healthy = lambda: _ready_json(url, "/readiness", lambda b: b.get("healthy_workers") == len(workers))  # noqa: E731
    wait_ready(proc, healthy, 120, "sglang-router", log)
    return proc, url


# ---- load ----------------------------------------------------------------------------------------
def _body(stream: bool, max_tokens: int) -> bytes:
    doc = {
        "model": MODEL,
        "messages": [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hello!"}],
        "max_tokens": max_tokens,
        "temperature": 0,
    }
    if stream:
        doc |= {"stream": True, "stream_options": {"include_usage": True}}
    return json.dumps(doc).encode()


async def _load(url: str, n: int, concurrency: int, stream: bool, chunks: int) -> tuple[int, int]:
    """Send n requests with `concurrency` in flight; (failures, data events received)."""
    body = _body(stream, chunks)
    headers = {"Content-Type": "application/json"}
    left, failures, events = [n], [0], [0]
    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=120)) as s:

        async def client() -> None:
            while left[0] > 0:
                left[0] -= 1
                async with s.post(url + "/v1/chat/completions", data=body, headers=headers) as r:
                    raw = await r.read()
                    if r.status != 200:
                        failures[0] += 1
                    elif stream:
                        events[0] += raw.count(b"data: {")

        await asyncio.gather(*(client() for _ in range(concurrency)))
    return failures[0], events[0]


def measure(name: str, proc: subprocess.Popen, url: str, args: argparse.Namespace) -> dict:
    asyncio.run(_load(url, 100, args.concurrency, False, 0))  # warm up: connections, caches
    asyncio.run(_load(url, 8, 8, True, args.chunks))
    out: dict = {"router": name}
    for phase, n, conc, stream in (
        ("chats", args.chats, args.concurrency, False),
        ("streams", args.streams, args.stream_concurrency, True),
    ):
        cpu0, t0 = benchkit.cpu_s(proc.pid), time.perf_counter()
        failures, events = asyncio.run(_load(url, n, conc, stream, args.chunks))
        wall, cpu = time.perf_counter() - t0, benchkit.cpu_s(proc.pid) - cpu0
        row = {"requests": n, "concurrency": conc, "failures": failures, "wall_s": round(wall, 3)}
        row["cpu_s"] = round(cpu, 3)
        if stream:
            row |= {"chunks_per_stream": args.chunks, "events_received": events}
            row["cpu_per_chunk_us"] = round(cpu / (n * args.chunks) * 1e6, 2)
        else:
            row["cpu_per_request_ms"] = round(cpu / n * 1e3, 4)
        out[phase] = row
        print(f"{name:14s} {phase:8s} {json.dumps(row)}", flush=True)
    return out


def start_workers(n: int, args: argparse.Namespace, tmp: Path) -> tuple[list[subprocess.Popen], list[str]]:
    """n stub workers, 8 ports to a process (a process each would cost 64 interpreters at 64 pods)."""
    ports = [free_port() for _ in range(n)]
    procs = []
    for i in range(0, n, 8):
        group = ports[i : i + 8]
        argv = [sys.executable, __file__, "--worker", ",".join(map(str, group))]
        argv += ["--chunk-gap-ms", str(args.chunk_gap_ms), "--chunks", str(args.chunks)]
        log = tmp / f"worker-{group[0]}.log"
        procs.append(benchkit.launch(argv, log, f"http://127.0.0.1:{group[-1]}", 60))
    return procs, [f"http://127.0.0.1:{p}" for p in ports]


def both_routers(args: argparse.Namespace, binary: str, tmp: Path) -> list[dict]:
    """`args.repeats` rounds of kvpilot's router then sglang-router, each fronting `args.workers` stubs."""
    worker_procs, workers = start_workers(args.workers, args, tmp)
    runs = []
    try:
        for _ in range(args.repeats):
            for name, start in (
                ("kvpilot", lambda: start_kvpilot(workers, tmp)),
                ("sglang-router", lambda: start_sglang(binary, workers, tmp)),
            ):
                proc, url = start()
                try:
                    runs.append(measure(name, proc, url, args) | {"workers": args.workers})
                finally:
                    benchkit.shutdown(proc)
    finally:
        for p in worker_procs:
            benchkit.shutdown(p)
    return runs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worker", metavar="PORT[,PORT...]", help=argparse.SUPPRESS)
    ap.add_argument("--workers", type=int, default=2, help="stub workers behind each router (default 2)")
    ap.add_argument("--chats", type=int, default=1500)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--streams", type=int, default=120)
    ap.add_argument("--stream-concurrency", type=int, default=8)
    ap.add_argument("--chunks", type=int, default=64)
    ap.add_argument("--chunk-gap-ms", type=float, default=1.0, help="the stub's pause between events")
    ap.add_argument("--repeats", type=int, default=2, help="rounds of both routers, alternating")
    ap.add_argument("--sglang-router", default=None, help="its binary (default: make tools-bindir's)")
    ap.add_argument("--label", default="", help="a note kept in the JSON (e.g. before/after)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    if args.worker:
        ports = [int(p) for p in args.worker.split(",")]
        asyncio.run(_serve_worker(ports, args.chunk_gap_ms / 1000, args.chunks))
        return

    load_before = os.getloadavg()
    binary = args.sglang_router or benchkit.tools_bin("sglang-router")
    tmp = Path(tempfile.mkdtemp(prefix="router-cost-"))
    runs = both_routers(args, binary, tmp)

    def best(name: str, phase: str, key: str) -> float:
        return min(r[phase][key] for r in runs if r["router"] == name)  # the least noisy run

    summary = {}
    for phase, key in (("chats", "cpu_per_request_ms"), ("streams", "cpu_per_chunk_us")):
        k, s = best("kvpilot", phase, key), best("sglang-router", phase, key)
        summary[phase] = {"kvpilot": k, "sglang_router": s, "ratio": round(k / s, 2)}
    summary["targets"] = {"chats_ratio_max": 2.0, "streams_ratio_max": 1.25}
    doc = benchkit.header("router_cost", load_before)
    doc |= {
        "label": args.label,
        "git": benchkit.git_head(),
        "args": {k: v for k, v in vars(args).items() if k != "out"},
    }
    doc |= {"summary": summary, "runs": runs}
    doc["args"]["sglang_router"] = binary
    print(json.dumps(summary, indent=2))
    benchkit.write(args.out or benchkit.default_path(ROOT / "bench" / "results", "router-cost"), doc)


if __name__ == "__main__":
    main()
