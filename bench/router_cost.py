"""Router CPU cost: kvpilot's router against the real `sglang-router` (PyPI), on the same stub workers.

`--workers` stub pods (2 by default; bench/stub_pods.py) answer OpenAI chat completions and completions at
once: a JSON reply with usage, or, for `"stream": true`, `--chunks` server-sent events sent one per write a
little apart (as an engine emits tokens), then the usage event and [DONE]. For the prefix rounds each stub
also keeps a prefix cache and publishes KV events as a kvpilot daemon does, so a prefix-aware kvpilot router
is fed by KV events, as in a real fleet.

Each router in turn fronts all of them and gets the same load from this process, first round-robin
(`kvpilot router --policy round-robin`, `sglang-router launch --policy round_robin`): N short chats at
concurrency C, N short completions, then S streams of K chunks; then by prefix (`kvpilot router --policy
prefix-aware`, `sglang-router --policy cache_aware`): the same chats and completions, and S/2 streams
(`--no-prefix` leaves these out). The chats and completions are short (one of 8 system prompts of ~60 tokens,
cycled, then a user line never sent before: ~80 tokens, under 1 KiB of JSON). What a router costs is the CPU
seconds of its process over each phase (its CPU-time clock, benchkit.cpu_s: all its threads): CPU per
request, and per streamed chunk (a stream's CPU over its chunks). The routers run one after the other,
`--repeats` times alternating, on the same machine state; the load average is written beside the figures,
and each kvpilot/sglang-router ratio in `summary`.

    .venv/bin/python bench/router_cost.py                      # 1500 chats and completions at 32; 120 streams of 64
    .venv/bin/python bench/router_cost.py --chats 300 --streams 20 --repeats 1   # a quick look

`sglang-router` comes from `make sglang-router` (~/.cache/kvpilot/tools/bin). Results go to
bench/results/router-cost-<UTC time>.json (--out to choose).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
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
sys.path.append(str(Path(__file__).resolve().parent))  # stub_pods

from stub_pods import MODEL, start_stub_pods

import benchkit
from devcluster.procs import free_port

ROOT = Path(__file__).resolve().parent.parent


# ---- processes -----------------------------------------------------------------------------------
def _ready_json(url: str, path: str, check) -> bool:
    with urllib.request.urlopen(url + path, timeout=5) as r:
        return check(json.loads(r.read()))


def start_kvpilot(workers: list[str], tmp: Path, policy: str = "round-robin") -> tuple[subprocess.Popen, str]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    # -P: the checkout (the cwd) not on the path: its kernels/ would shadow the package transformers imports
    argv = [sys.executable, "-P", "-m", "kvpilot", "router", "--policy", policy]
    argv += ["--host", "127.0.0.1", "--port", str(port), "--endpoints", ",".join(workers)]

    def ready(health: dict) -> bool:
        pods = health.get("pods", [])
        # every pod ready, and its KV events followed where it publishes them
        return sum(bool(p.get("ready")) and p.get("kv_events") != "pending" for p in pods) == len(
            workers
        ) and all(p.get("synced") for p in pods if p.get("kv_events") == "on")

    return benchkit.launch(argv, tmp / "kvpilot-router.log", url, 120, ready=ready), url


def start_sglang(
    binary: str, workers: list[str], tmp: Path, policy: str = "round_robin"
) -> tuple[subprocess.Popen, str]:
    from devcluster.procs import spawn, wait_ready

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    argv = [binary, "launch", "--host", "127.0.0.1", "--port", str(port), "--worker-urls", *workers]
    argv += [
        "--policy",
        policy,
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
SYSTEMS = [
    f"You are assistant number {i}, a terse helper for the {topic} team. Answer in one short sentence, "
    "name no sources, never apologise, keep numbers exact, and say so when a question is outside what "
    f"the {topic} team handles."
    for i, topic in enumerate(
        ("billing", "search", "storage", "network", "kernel", "mobile", "data", "infra")
    )
]
CHAT_PATH, COMPLETION_PATH = "/v1/chat/completions", "/v1/completions"


def _request(path: str, stream: bool, max_tokens: int, i: int) -> bytes:
    """Request `i` of a phase: one of 8 system prompts (cycled), then a user line of its own (each
    request's differs: no cache keyed on a whole text, the router's or a tokenizer's, serves it)."""
    system, user = (
        SYSTEMS[i % len(SYSTEMS)],
        f"Question {i}: what does step {i % 7} of the runbook do, in brief?",
    )
    doc: dict = {"model": MODEL, "max_tokens": max_tokens, "temperature": 0}
    if path == CHAT_PATH:
        doc["messages"] = [{"role": "system", "content": system}, {"role": "user", "content": user}]
    else:
        doc["prompt"] = f"{system}\n\n{user}"
    if stream:
        doc |= {"stream": True, "stream_options": {"include_usage": True}}
    return json.dumps(doc).encode()


def _body(stream: bool, max_tokens: int) -> bytes:
    return _request(CHAT_PATH, stream, max_tokens, 0)


async def _load(
    url: str, n: int, concurrency: int, stream: bool, chunks: int, path: str = CHAT_PATH
) -> tuple[int, int]:
    """Send n requests to `path` with `concurrency` in flight; (failures, data events received)."""
    bodies = [_request(path, stream, chunks if stream else 8, next(_numbers)) for _ in range(n)]
    headers = {"Content-Type": "application/json"}
    left, failures, events = [n], [0], [0]
    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=120)) as s:

        async def client() -> None:
            while left[0] > 0:
                left[0] -= 1
                body = bodies[left[0]]
                async with s.post(url + path, data=body, headers=headers) as r:
                    raw = await r.read()
                    if r.status != 200:
                        failures[0] += 1
                    elif stream:
                        events[0] += raw.count(b"data: {")

        await asyncio.gather(*(client() for _ in range(concurrency)))
    return failures[0], events[0]


_numbers = itertools.count()  # over the whole run: no user line is sent twice


# (phase, path, streamed): what each router gets, in order (`--completions 0` and `--streams 0` drop theirs)
PHASES = (("chats", CHAT_PATH, False), ("completions", COMPLETION_PATH, False), ("streams", CHAT_PATH, True))


def measure(
    name: str, proc: subprocess.Popen, url: str, args: argparse.Namespace, streams: int | None = None
) -> dict:
    asyncio.run(_load(url, 100, args.concurrency, False, 0))  # warm up: connections, caches, the index
    asyncio.run(_load(url, 100, args.concurrency, False, 0, COMPLETION_PATH))
    asyncio.run(_load(url, 8, 8, True, args.chunks))
    out: dict = {"router": name}
    counts = {
        "chats": args.chats,
        "completions": getattr(args, "completions", 0),
        "streams": args.streams if streams is None else streams,
    }
    for phase, path, stream in PHASES:
        n, conc = counts[phase], args.stream_concurrency if stream else args.concurrency
        if n <= 0:
            continue
        cpu0, t0 = benchkit.cpu_s(proc.pid), time.perf_counter()
        failures, events = asyncio.run(_load(url, n, conc, stream, args.chunks, path))
        wall, cpu = time.perf_counter() - t0, benchkit.cpu_s(proc.pid) - cpu0
        row = {"requests": n, "concurrency": conc, "failures": failures, "wall_s": round(wall, 3)}
        row["cpu_s"] = round(cpu, 3)
        if stream:
            row |= {"chunks_per_stream": args.chunks, "events_received": events}
            row["cpu_per_chunk_us"] = round(cpu / (n * args.chunks) * 1e6, 2)
        else:
            row["cpu_per_request_ms"] = round(cpu / n * 1e3, 4)
        out[phase] = row
        print(f"{name:14s} {phase:11s} {json.dumps(row)}", flush=True)
    if name == "kvpilot":
        out["routing"] = _routing(url)
    return out


def _routing(url: str) -> dict:
    """How kvpilot's router routed the run (warm-up included): its decisions by reason, and the cached
    tokens it predicted against those the stubs reported (the prefix rounds: the KV events were followed)."""
    got: dict = {}
    for key, value in benchkit.metrics(url).items():
        name = key.partition("{")[0]
        if name == "kvpilot_router_routing_decisions_total":
            reason = key.partition('reason="')[2].partition('"')[0]
            got[f"decisions_{reason}"] = got.get(f"decisions_{reason}", 0) + int(value)
        elif name in (
            "kvpilot_router_predicted_cached_tokens_total",
            "kvpilot_router_reported_cached_tokens_total",
        ):
            short = name.removeprefix("kvpilot_router_").removesuffix("_total")
            got[short] = got.get(short, 0) + int(value)
    return got


# (label, kvpilot's --policy, sglang-router's --policy)
POLICIES = (("round_robin", "round-robin", "round_robin"), ("prefix", "prefix-aware", "cache_aware"))


def both_routers(args: argparse.Namespace, binary: str, tmp: Path) -> list[dict]:
    """`args.repeats` rounds of kvpilot's router then sglang-router, each fronting `args.workers` stubs:
    round-robin, then (with `args.prefix`) by prefix, kvpilot's fed by the stubs' KV events."""
    worker_procs, workers = start_stub_pods(
        args.workers,
        tmp,
        chunks=args.chunks,
        chunk_gap_ms=args.chunk_gap_ms,
        kv_events=getattr(args, "prefix", False),
    )
    policies = POLICIES if getattr(args, "prefix", False) else POLICIES[:1]
    runs = []
    try:
        for _ in range(args.repeats):
            for label, ours, theirs in policies:
                streams = args.streams if label == "round_robin" else args.streams // 2
                for name, start in (
                    ("kvpilot", lambda ours=ours: start_kvpilot(workers, tmp, ours)),
                    ("sglang-router", lambda theirs=theirs: start_sglang(binary, workers, tmp, theirs)),
                ):
                    for w in workers:  # cold caches for each router: what it knows of them is exact
                        urllib.request.urlopen(
                            urllib.request.Request(w + "/reset_prefix_cache", method="POST")
                        )
                    proc, url = start()
                    try:
                        run = measure(name, proc, url, args, streams)
                        runs.append(run | {"workers": args.workers, "policy": label})
                    finally:
                        benchkit.shutdown(proc)
    finally:
        for p in worker_procs:
            benchkit.shutdown(p)
    return runs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", type=int, default=2, help="stub workers behind each router (default 2)")
    ap.add_argument("--chats", type=int, default=1500)
    ap.add_argument(
        "--completions", type=int, default=None, help="non-streamed completions (default: --chats)"
    )
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--streams", type=int, default=120)
    ap.add_argument("--stream-concurrency", type=int, default=8)
    ap.add_argument("--chunks", type=int, default=64)
    ap.add_argument("--chunk-gap-ms", type=float, default=1.0, help="the stub's pause between events")
    ap.add_argument("--repeats", type=int, default=2, help="rounds of both routers, alternating")
    ap.add_argument(
        "--no-prefix",
        dest="prefix",
        action="store_false",
        help="round-robin only (no prefix-aware/cache_aware rounds, no KV events from the stubs)",
    )
    ap.add_argument("--sglang-router", default=None, help="its binary (default: make tools-bindir's)")
    ap.add_argument("--label", default="", help="a note kept in the JSON (e.g. before/after)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    if args.completions is None:
        args.completions = args.chats

    load_before = os.getloadavg()
    binary = args.sglang_router or benchkit.tools_bin("sglang-router")
    tmp = Path(tempfile.mkdtemp(prefix="router-cost-"))
    runs = both_routers(args, binary, tmp)

    def best(name: str, policy: str, phase: str, key: str) -> float | None:
        got = [r[phase][key] for r in runs if r["router"] == name and r["policy"] == policy and phase in r]
        return min(got) if got else None  # the least noisy run

    summary: dict = {}
    for label, _, _ in POLICIES if args.prefix else POLICIES[:1]:
        by_phase = {}
        for phase, _, stream in PHASES:
            key = "cpu_per_chunk_us" if stream else "cpu_per_request_ms"
            k, s = best("kvpilot", label, phase, key), best("sglang-router", label, phase, key)
            if k is not None and s is not None:
                by_phase[phase] = {"kvpilot": k, "sglang_router": s, "ratio": round(k / s, 2) if s else None}
        summary[label] = by_phase
    # as before the prefix rounds: the round-robin figures at the top too
    summary |= {p: v for p, v in summary["round_robin"].items() if p in ("chats", "streams")}
    summary["targets"] = {"chats_ratio_max": 2.0, "completions_ratio_max": 2.0, "streams_ratio_max": 1.25}
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
