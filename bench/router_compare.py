"""Four routers on one load: kvpilot's prefix-aware router, vllm-router's kv_aware fed by the daemons' KV
events, sglang-router's cache_aware, and round-robin (kvpilot's router) as the baseline.

Two `kvpilot serve` daemons (the default model, each with about half the system prompts' KV blocks,
publishing KV events with token ids) take, through each router in turn, the load of bench/router.py: 8
shared system prompts x 6 users (48 streamed chats, greedy, 4 tokens each) at concurrency 6, shuffled.
Halfway through, one daemon's prefix cache is reset directly, behind the router's back, as an operator's
`PrefixCacheReset` or another client would: a router that follows KV events (kvpilot's, vllm-router)
hears of it; one that guesses from what it sent (sglang-router) keeps sending that pod's prompts there.

Each run starts a fresh router, warms it with two unrelated chats, resets both daemons (cold caches),
then sends the load. Per run: the fleet's hit share (cached / prompt tokens, from each reply's `usage`),
the requests that found nothing cached (at best 12 here: each system prompt once, and again those of the
reset pod's that come back, 4 when the pods hold 4 each),
TTFT p50 and p99 as the client sees them, and the router's CPU per request (its process tree's
CPU-time clocks over the load, benchkit.cpu_s, its idle timers and health checks included: its CPU a second
idle, measured for 3 s before the load, is written beside it; vllm-router also asks a daemon's `POST /tokenize` for each
request's ids, CPU the daemon spends, not the router). The routers run in turn, `--repeats` times in a
rotating order, on the same daemons; a router's figure is the median of its runs.

    .venv/bin/python bench/router_compare.py                 # 8 x 6 at 6, 2 repeats
    .venv/bin/python bench/router_compare.py --repeats 1     # a quicker look

The third-party routers come from `make tools` (sglang-router 0.3.2, vllm-router 0.1.17). Results go to
bench/results/router-compare-<UTC time>.json (--out to choose).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parents[1] / "hack" / "lib"))  # benchkit, devcluster

import benchkit
from devcluster.procs import free_port, spawn, wait_ready

ROOT = Path(__file__).resolve().parent.parent
LOAD = benchkit.bench_module(ROOT / "bench" / "router.py")  # the shops' system prompts, daemons, load
BLOCK = 16  # the daemons' block size (kvpilot serve's default), which vllm-router must be told
IDLE_S = 3.0  # seconds the router's idle CPU is measured, before the load
ROUTERS = ("kvpilot prefix-aware", "vllm-router kv_aware", "sglang-router cache_aware", "round-robin")


def _get(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status, r.read()
    except OSError:
        return 0, b""


def _third_party(name: str, argv: list[str], url: str, ready: Callable[[], bool], tmp: Path):
    log = tmp / f"{name}-{free_port()}.log"
    proc = spawn(argv, log_path=log, cwd=tmp, env={**os.environ, "NO_COLOR": "1"})  # outside the checkout
    wait_ready(proc, ready, 120, name, log)
    return proc


def start_router(name: str, daemons: list[str], token_file: Path, tmp: Path):
    """The router `name` (one of ROUTERS) in front of `daemons`: (its process, its URL)."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    if name in ("kvpilot prefix-aware", "round-robin"):
        policy = name.removeprefix("kvpilot ")
        return LOAD.start_router(policy, daemons, token_file, tmp / f"kvpilot-{policy}-{port}.log")
    if name == "sglang-router cache_aware":
        argv = [benchkit.tools_bin("sglang-router"), "launch", "--host", "127.0.0.1", "--port", str(port)]
        argv += ["--worker-urls", *daemons, "--policy", "cache_aware"]
        argv += ["--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port())]

        def healthy() -> bool:
            status, body = _get(url + "/readiness")
            return status == 200 and json.loads(body).get("healthy_workers") == len(daemons)

        return _third_party("sglang-router", argv, url, healthy, tmp), url
    argv = [benchkit.tools_bin("vllm-router"), "--host", "127.0.0.1", "--port", str(port)]
    argv += ["--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port())]
    argv += ["--policy", "kv_aware", "--worker-urls", *daemons]
    for d in daemons:  # vllm-router takes each pod's event endpoint as a static URL=ENDPOINT
        _, body = _get(d + "/kv_events")
        argv += ["--kv-event-source", f"{d}={json.loads(body)['endpoint']}"]
    argv += ["--kv-event-block-size", str(BLOCK), "--kv-event-model", LOAD.MODEL]
    proc = _third_party("vllm-router", argv, url, lambda: _get(url + "/health")[0] == 200, tmp)
    time.sleep(2)  # its ZeroMQ subscriptions connect after /health answers: let them join first
    return proc, url


def served(daemon: str) -> float:
    """Requests the daemon has admitted so far (its TTFT histogram's count)."""
    _, body = _get(daemon + "/metrics")
    for line in body.decode().splitlines():
        if line.startswith("kvpilot_time_to_first_token_seconds_count"):
            return float(line.rpartition(" ")[2])
    return 0.0


def one_run(name: str, daemons: list[str], work: list, args: argparse.Namespace, token_file: Path, tmp: Path):
    proc, url = start_router(name, daemons, token_file, tmp)
    try:
        asyncio.run(LOAD.run_load(url, [("You are terse.", "Hi!"), ("Be brief.", "Hello!")], 2, 2))
        for d in daemons:
            asyncio.run(LOAD.direct_reset(d))
        idle0 = benchkit.cpu_s(proc.pid)
        time.sleep(IDLE_S)  # the resets' AllBlocksCleared reach the routers that follow events
        idle = benchkit.cpu_s(proc.pid) - idle0
        before = [served(d) for d in daemons]
        cpu0, t0 = benchkit.cpu_s(proc.pid), time.perf_counter()
        half = len(work) // 2
        results = asyncio.run(LOAD.run_load(url, work[:half], args.concurrency, args.max_tokens))
        asyncio.run(LOAD.direct_reset(daemons[0]))  # behind the router's back
        results += asyncio.run(LOAD.run_load(url, work[half:], args.concurrency, args.max_tokens))
        wall, cpu = time.perf_counter() - t0, benchkit.cpu_s(proc.pid) - cpu0
    finally:
        benchkit.shutdown(proc)
    run = {"router": name} | LOAD.summarize(results)
    run["requests_per_pod"] = [round(served(d) - b) for d, b in zip(daemons, before, strict=True)]
    run |= {"wall_s": round(wall, 2), "router_cpu_s": round(cpu, 3)}
    run["router_cpu_ms_per_request"] = round(cpu / len(results) * 1e3, 3)
    run["router_idle_cpu_ms_per_s"] = round(idle / IDLE_S * 1e3, 2)  # its own timers, polls, health checks
    print(
        f"{name:26s} hit {run['prefix_hit_rate']:.3f}  cold {run['cold_requests']:2d}  TTFT p50 {run['ttft_p50_ms']:6.0f} ms  "
        f"p99 {run['ttft_p99_ms']:6.0f} ms  CPU {run['router_cpu_ms_per_request']:.2f} ms/request  "
        f"pods {run['requests_per_pod']}  errors {run['errors']}",
        flush=True,
    )
    return run


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", type=int, default=8, help="shared system prompts (default 8)")
    p.add_argument("--users", type=int, default=6, help="users per system prompt (default 6)")
    p.add_argument("--concurrency", type=int, default=6, help="concurrent clients (default 6)")
    p.add_argument("--max-tokens", type=int, default=4, help="tokens generated per request (default 4)")
    p.add_argument("--kv-blocks", type=int, default=64, help="KV blocks per daemon (default 64)")
    p.add_argument("--repeats", type=int, default=2, help="runs per router, in a rotating order (default 2)")
    p.add_argument(
        "--routers", default=",".join(ROUTERS), help="a comma-separated subset of: " + ", ".join(ROUTERS)
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--label", default="", help="a note kept in the JSON (e.g. before/after)")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    routers = [r.strip() for r in args.routers.split(",") if r.strip()]
    unknown = sorted(set(routers) - set(ROUTERS))
    if unknown:
        p.error(f"--routers: unknown {unknown}; choose from {list(ROUTERS)}")

    rng = random.Random(args.seed)
    systems = [LOAD.system_prompt(LOAD.SHOPS[i % len(LOAD.SHOPS)] + f" {i}") for i in range(args.prompts)]
    work = [
        (s, LOAD.QUESTIONS[u % len(LOAD.QUESTIONS)] + f" ({u})") for s in systems for u in range(args.users)
    ]
    rng.shuffle(work)

    load_before = os.getloadavg()
    tmp = Path(tempfile.mkdtemp(prefix="router-compare-"))
    token_file = tmp / "token"
    token_file.write_text(LOAD.TOKEN)
    procs: list[subprocess.Popen] = []
    runs: list[dict] = []
    try:
        daemons = []
        for i in range(2):
            proc, url = LOAD.start_daemon(
                args.kv_blocks,
                token_file,
                tmp / f"daemon-{i}.log",
                free_port(),
                free_port(),
                "--kv-events-token-ids",
            )
            procs.append(proc)
            daemons.append(url)
        for rep in range(args.repeats):
            shift = rep % len(routers)  # each router goes first once in len(routers) rounds
            for name in routers[shift:] + routers[:shift]:
                runs.append(one_run(name, daemons, work, args, token_file, tmp) | {"repeat": rep})
    finally:
        for proc in procs:
            benchkit.shutdown(proc)

    summary = {}
    for name in routers:
        mine = [r for r in runs if r["router"] == name]
        summary[name] = {
            key: round(statistics.median(r[key] for r in mine), 3)
            for key in (
                "prefix_hit_rate",
                "cold_requests",
                "ttft_p50_ms",
                "ttft_p99_ms",
                "router_cpu_ms_per_request",
                "router_idle_cpu_ms_per_s",
            )
        } | {"errors": sum(r["errors"] for r in mine)}
    print(json.dumps(summary, indent=2))
    doc = benchkit.header("router_compare", load_before) | {"label": args.label, "git": benchkit.git_head()}
    doc |= {
        "model": LOAD.MODEL,
        "workload": LOAD.workload(args, work)
        | {"flushed_behind_the_router": "daemon 0, after half the requests"},
        "summary": summary,
        "runs": runs,
    }
    benchkit.write(args.out or benchkit.default_path(ROOT / "bench" / "results", "router-compare"), doc)
    return 1 if any(s["errors"] for s in summary.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
