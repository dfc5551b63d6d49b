"""Prefill/decode disaggregation against colocated serving: the same load on two daemons either way.

- **colocated**: two `kvpilot serve` daemons, each prefilling and decoding, behind
  `kvpilot router --endpoints A,B` (prefix-aware).
- **P/D**: one prefill daemon (`kv_role` `kv_producer`) and one decode daemon (`kv_consumer`) behind
  `kvpilot router --prefill A --decode B`: each chat is prefilled on A, its KV pulled by B over the transfer
  port, and decoded on B (docs/disaggregation.md).

Each daemon is pinned to a core of its own (`taskset`, `--cpu-threads 1`), so each side has two machines'
worth of compute; the router and this script are not pinned (they share both cores). Daemons start from a
temporary folder (outside the checkout), PYTHONSAFEPATH=1.

The load (a fixed seed): streamed chats, greedy, `--max-tokens` tokens each (ignore_eos), arriving open loop
(exponential gaps of mean `--gap` s, not waiting for replies), so long prompts (a shared system prompt, one of
`--systems`, plus a note to summarise: ~400-1000 tokens in all) arrive while others decode. Each mode starts
from fresh daemons, warmed by a few unrelated chats, then reset (cold caches).

Per mode: decode inter-token latency p50/p99 (gaps between the streamed content chunks' arrivals at the
client), TTFT p50/p99, output tokens/s (completion tokens over the load's wall time). For P/D also: the KV
transfer bandwidth (the decode daemon's kvpilot_kv_transfer_bytes_total{direction="received"} over the sum of
its kvpilot_kv_transfer_seconds, each pull connect to last byte) against a plain socket copy of the same bytes
in as many connections over loopback, measured here after the load; and the blocks decode-side reuse saved:
the prompts' held blocks (the full blocks of each prompt but its last token: what a prefill holds) minus the
blocks the decode daemon pulled (kvpilot_kv_transfer_blocks_total{direction="received"}).

    PYTHONSAFEPATH=1 .venv/bin/python bench/disagg.py            # 32 chats a mode, one every 2.5 s, 64 tokens
    PYTHONSAFEPATH=1 .venv/bin/python bench/disagg.py --quick    # 6 chats, 8 tokens: a test's size

Results go to bench/results/disagg-<UTC time>.json (--out to choose); a short summary to stdout.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import aiohttp

sys.path.append(str(Path(__file__).resolve().parents[1] / "hack" / "lib"))  # benchkit, devcluster

import benchkit
from devcluster.procs import free_port, spawn, wait_ready
from kvpilot.cli.loadgen import pct

ROOT = Path(__file__).resolve().parent.parent
MODEL = "SmolLM2-135M-Instruct"
TOKEN = "bench-disagg-token"
BLOCK = 16  # the daemons' block size (kvpilot serve's default)
MODES = ("colocated", "pd")
QUICK = {"requests": 6, "gap": 1.0, "max_tokens": 8, "systems": 2}

TOPICS = ["a harbour museum", "a mountain railway", "a city library", "a bicycle workshop", "a night market"]
WORDS = (
    "the visitors asked about opening hours tickets guided tours parking access lifts cafe shop exhibits "
    "maps audio guides school groups discounts members weekend events lectures repairs storage lockers "
    "strollers wheelchairs photography rules lost property staff volunteers donations archive research "
    "reading rooms quiet areas charging points wifi printing copies returns delays weather closures "
    "holidays season winter summer spring autumn morning evening queue entrance exit garden roof terrace "
    "bridge station platform train carriage driver timetable fare card refund ticket office counter desk "
    "shelf book journal map chart lamp engine wheel chain brake saddle tyre pump bell light helmet lock "
    "stall lantern spice noodle tea fruit bread cheese fish soup rice pepper honey candle scarf toy"
).split()


def system_prompt(topic: str) -> str:
    """~300 tokens: what every chat about `topic` shares (the part decode-side reuse can keep)."""
    return (
        f"You are the assistant of {topic}. You read the visitors' notes the staff of {topic} collected "
        "during the day and answer with a short, factual summary: what visitors asked about most, what they "
        "complained about, and one thing the staff should change tomorrow. Never invent a note, never name a "
        "visitor, and keep a neutral, friendly tone. "
    ) * 3


def workload(args: argparse.Namespace) -> list[dict]:
    """The chats in arrival order: each a system prompt, a note of seeded random length, its send time."""
    rng = random.Random(args.seed)
    systems = [system_prompt(TOPICS[i % len(TOPICS)]) for i in range(args.systems)]
    at, work = 0.0, []
    for i in range(args.requests):
        words = rng.randint(args.note_words[0], args.note_words[1])
        note = " ".join(rng.choice(WORDS) for _ in range(words))
        work.append({"system": systems[i % len(systems)], "user": f"Notes {i}: {note}", "at": round(at, 3)})
        at += rng.expovariate(1 / args.gap)
    return work


# ---- processes -------------------------------------------------------------------------------------
def pinned_cores() -> list[int]:
    """Two cores for the two daemons (the same one twice on a one-CPU machine)."""
    cpus = sorted(os.sched_getaffinity(0))
    return [cpus[0], cpus[1 % len(cpus)]]


def start(command: list[str], log: Path, url: str, ready, core: int | None = None):  # noqa: ANN001, ANN201
    """`python -m kvpilot COMMAND` (pinned to `core` by taskset when given) from the log's folder, outside
    the checkout, without the caller's $KVPILOT_ADMIN_TOKEN; returns once `ready()` holds."""
    argv = [sys.executable, "-m", "kvpilot", *command]
    if core is not None:
        argv = ["taskset", "-c", str(core), *argv]
    env = {k: v for k, v in os.environ.items() if k != "KVPILOT_ADMIN_TOKEN"} | {"PYTHONSAFEPATH": "1"}
    proc = spawn(argv, log_path=log, env=env, cwd=log.parent)
    wait_ready(proc, ready, 600, f"kvpilot {command[0]} ({log.name})", log)
    return proc


def start_daemon(name: str, core: int, args: argparse.Namespace, tmp: Path, *extra: str):  # noqa: ANN201
    """A `kvpilot serve` on one core and one torch thread, publishing KV events: (process, URL)."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = ["serve", "--host", "127.0.0.1", "--port", str(port), "--cpu-threads", "1"]
    cmd += ["--max-num-seqs", str(args.max_num_seqs), "--num-gpu-blocks-override", str(args.kv_blocks)]
    cmd += ["--admin-token-file", str(tmp / "token")]
    cmd += ["--kv-events-endpoint", f"tcp://127.0.0.1:{free_port()}"]
    cmd += ["--kv-events-replay-endpoint", f"tcp://127.0.0.1:{free_port()}", *extra]
    return start(cmd, tmp / f"{name}.log", url, lambda: benchkit.health(url) is not None, core), url


def transfer_config(role: str) -> str:
    extra = {"port": free_port()} if role == "kv_producer" else {}
    return json.dumps(
        {"kv_connector": "KvpilotConnector", "kv_role": role, "kv_connector_extra_config": extra}
    )


def start_router(pods: list[str], tmp: Path, name: str):  # noqa: ANN201
    """`kvpilot router POD_FLAGS` (unpinned), ready once every pod is ready and its KV events synced."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = ["router", "--host", "127.0.0.1", "--port", str(port), "--admin-token-file", str(tmp / "token")]

    def ready() -> bool:
        got = benchkit.health(url).get("pods") or []
        return bool(got) and all(p.get("ready") and p.get("synced", True) for p in got)

    return start([*cmd, *pods], tmp / f"router-{name}.log", url, ready), url


def fleet_reset(url: str) -> None:
    req = urllib.request.Request(
        url + "/reset_prefix_cache", method="POST", headers={"Authorization": f"Bearer {TOKEN}"}
    )
    with urllib.request.urlopen(req, timeout=120) as r:
        r.read()


# ---- load ------------------------------------------------------------------------------------------
async def timed_chat(session: aiohttp.ClientSession, url: str, item: dict, max_tokens: int) -> dict:
    """One streamed chat, greedy, exactly `max_tokens` tokens: its time to the first content chunk, the
    gaps between the content chunks' arrivals after it (the client's inter-token latency), its usage."""
    body = {
        "model": MODEL,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
        "messages": [
            {"role": "system", "content": item["system"]},
            {"role": "user", "content": item["user"]},
        ],
    }
    start = time.perf_counter()
    arrivals, usage = [], {}
    async with session.post(url + "/v1/chat/completions", json=body) as resp:
        if resp.status != 200:
            return {"error": f"HTTP {resp.status}: {(await resp.text())[:200]}"}
        pod = resp.headers.get("X-Kvpilot-Pod")
        async for raw in resp.content:
            line = raw.strip()
            if not line.startswith(b"data: {"):
                continue
            now = time.perf_counter()
            event = json.loads(line[6:])
            usage = event.get("usage") or usage
            if any((c.get("delta") or {}).get("content") for c in event.get("choices") or []):
                arrivals.append(now)
    end = time.perf_counter()
    if not arrivals:
        return {"error": "no content chunk"}
    return {
        "pod": pod,
        "start": start,
        "end": end,
        "ttft": arrivals[0] - start,
        "itl": [b - a for a, b in zip(arrivals, arrivals[1:], strict=False)],
        "prompt_tokens": usage.get("prompt_tokens", 0),
        "completion_tokens": usage.get("completion_tokens", 0),
        "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0),
    }


async def open_loop(url: str, work: list[dict], max_tokens: int) -> list[dict]:
    """Every chat sent at its time from the start, whatever is still running."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=1800)) as session:
        t0 = time.perf_counter()

        async def one(item: dict) -> dict:
            await asyncio.sleep(max(0.0, t0 + item["at"] - time.perf_counter()))
            return await timed_chat(session, url, item, max_tokens)

        return await asyncio.gather(*(one(item) for item in work))


def warm_up(url: str) -> None:
    """A few unrelated chats, so both daemons' first steps (allocation, kernels) are out of the way."""
    work = [
        {"system": "Be brief.", "user": f"Say hello number {i}. " + "please " * 40, "at": 0.0}
        for i in range(4)
    ]
    for r in asyncio.run(open_loop(url, work, 4)):
        if "error" in r:
            raise RuntimeError(f"warm-up chat failed: {r['error']}")


# ---- one mode --------------------------------------------------------------------------------------
def delta(after: dict[str, float], before: dict[str, float], key: str) -> float:
    return after.get(key, 0.0) - before.get(key, 0.0)


def summarize(results: list[dict]) -> dict:
    ok = [r for r in results if "error" not in r]
    itl = [g for r in ok for g in r["itl"]]
    ttft = [r["ttft"] for r in ok]
    out_tokens = sum(r["completion_tokens"] for r in ok)
    wall = max(r["end"] for r in ok) - min(r["start"] for r in ok) if ok else float("nan")
    pods: dict[str, int] = {}
    for r in ok:
        pods[r["pod"]] = pods.get(r["pod"], 0) + 1
    prompts = [r["prompt_tokens"] for r in ok]
    return {
        "requests": len(results),
        "errors": len(results) - len(ok),
        "error_samples": [r["error"] for r in results if "error" in r][:3],
        "prompt_tokens": {
            "min": min(prompts, default=0),
            "max": max(prompts, default=0),
            "sum": sum(prompts),
        },
        "cached_tokens": sum(r["cached_tokens"] for r in ok),
        "output_tokens": out_tokens,
        "wall_s": round(wall, 3),
        "output_tokens_per_s": round(out_tokens / wall, 2) if ok else None,
        "itl_p50_ms": round(pct(itl, 50) * 1e3, 2),
        "itl_p99_ms": round(pct(itl, 99) * 1e3, 2),
        "itl_max_ms": round(max(itl, default=float("nan")) * 1e3, 2),
        "itl_mean_ms": round(statistics.fmean(itl) * 1e3, 2) if itl else None,
        "ttft_p50_ms": round(pct(ttft, 50) * 1e3, 1),
        "ttft_p99_ms": round(pct(ttft, 99) * 1e3, 1),
        "requests_per_pod": pods,
    }


def held_blocks(results: list[dict]) -> int:
    """The blocks the prefill pod held for the decode pod: each prompt's full blocks but its last token's
    (the decode pod computes that one, for the first token's logits)."""
    return sum((r["prompt_tokens"] - 1) // BLOCK for r in results if "error" not in r)


def run_mode(mode: str, work: list[dict], args: argparse.Namespace, tmp: Path) -> dict:
    cores = pinned_cores()
    procs: list[subprocess.Popen] = []
    try:
        daemons: list[str] = []
        if mode == "colocated":
            for i in range(2):
                proc, url = start_daemon(f"{mode}-{i}", cores[i], args, tmp)
                procs.append(proc)
                daemons.append(url)
            router_proc, router = start_router(["--endpoints", ",".join(daemons)], tmp, mode)
        else:
            proc, prefill = start_daemon(
                "pd-prefill", cores[0], args, tmp, "--kv-transfer-config", transfer_config("kv_producer")
            )
            procs.append(proc)
            proc, decode = start_daemon(
                "pd-decode", cores[1], args, tmp, "--kv-transfer-config", transfer_config("kv_consumer")
            )
            procs.append(proc)
            daemons += [prefill, decode]
            router_proc, router = start_router(["--prefill", prefill, "--decode", decode], tmp, mode)
        procs.append(router_proc)
        warm_up(router)
        fleet_reset(router)  # cold caches: the load starts as each mode's first traffic
        time.sleep(1)  # the resets' KV events reach the router
        before = [benchkit.metrics(d) for d in daemons]
        router_before = benchkit.metrics(router)
        results = asyncio.run(open_loop(router, work, args.max_tokens))
        after = [benchkit.metrics(d) for d in daemons]
        router_after = benchkit.metrics(router)
        run = {"mode": mode, "pinned_cores": cores} | summarize(results)
        if mode == "pd":
            run["kv_transfer"] = transfer_figures(results, before, after)
            run["router_pd_requests"] = {
                k.split('"')[1]: delta(router_after, router_before, k)
                for k in router_after
                if k.startswith("kvpilot_router_pd_requests_total{")
            }
        return run
    finally:
        for proc in reversed(procs):
            benchkit.shutdown(proc)


def transfer_figures(results: list[dict], before: list[dict], after: list[dict]) -> dict:
    """What the decode pod pulled (its /metrics), what a plain loopback copy of the same bytes takes, and the
    blocks it did not pull because it held them already."""
    sent = 'kvpilot_kv_transfer_blocks_total{direction="sent"}'
    received = 'kvpilot_kv_transfer_blocks_total{direction="received"}'
    nbytes = delta(after[1], before[1], 'kvpilot_kv_transfer_bytes_total{direction="received"}')
    seconds = delta(after[1], before[1], "kvpilot_kv_transfer_seconds_sum")
    pulls = int(delta(after[1], before[1], "kvpilot_kv_transfer_seconds_count"))
    failures = {
        k.split('"')[1]: delta(after[1], before[1], k)
        for k in after[1]
        if k.startswith("kvpilot_kv_transfer_failures_total{") and delta(after[1], before[1], k)
    }
    blocks = int(delta(after[1], before[1], received))
    held = held_blocks(results)
    out = {
        "pulls": pulls,
        "blocks_received": blocks,
        "blocks_sent_by_prefill_pod": int(delta(after[0], before[0], sent)),
        "bytes_received": int(nbytes),
        "pull_seconds_sum": round(seconds, 4),
        "pull_ms_mean": round(seconds / pulls * 1e3, 2) if pulls else None,
        "bandwidth_gbit_s": round(nbytes * 8 / seconds / 1e9, 3) if seconds else None,
        "failures": failures,
        "held_blocks": held,
        "decode_cached_blocks": sum(r["cached_tokens"] for r in results if "error" not in r) // BLOCK,
        "blocks_reused_on_decode_pod": held - blocks,
        "reuse_share": round((held - blocks) / held, 3) if held else None,
    }
    if pulls and nbytes:
        ref = socket_copy(int(nbytes), pulls)
        out["socket_copy"] = ref
        out["bandwidth_over_socket_copy"] = round(out["bandwidth_gbit_s"] / ref["bandwidth_gbit_s"], 3)
    return out


# ---- the loopback reference -------------------------------------------------------------------------
def socket_copy(total: int, connections: int, rounds: int = 3) -> dict:
    """`total` bytes over loopback TCP in `connections` connections, as the pulls went: each connects, asks
    (a few bytes) and reads its share to the last byte. Seconds summed over the connections, the median of
    `rounds` rounds."""
    size = max(1, total // connections)
    payload = memoryview(bytes(size))
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    def serve() -> None:
        for _ in range(connections * rounds):
            conn, _ = listener.accept()
            with conn:
                conn.recv(16)
                conn.sendall(payload)

    sender = threading.Thread(target=serve, daemon=True)
    sender.start()
    sink = bytearray(1 << 20)
    times = []
    for _ in range(rounds):
        spent = 0.0
        for _ in range(connections):
            t0 = time.perf_counter()
            with socket.create_connection(("127.0.0.1", port)) as s:
                s.sendall(b"pull")
                left = size
                while left:
                    n = s.recv_into(sink, min(left, len(sink)))
                    if not n:
                        raise RuntimeError("the loopback sender closed early")
                    left -= n
            spent += time.perf_counter() - t0
        times.append(spent)
    sender.join(timeout=10)
    listener.close()
    seconds = statistics.median(times)
    return {
        "bytes": size * connections,
        "connections": connections,
        "seconds": round(seconds, 4),
        "bandwidth_gbit_s": round(size * connections * 8 / seconds / 1e9, 3),
    }


# ---- main ------------------------------------------------------------------------------------------
def ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 2) if a and b else None


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=32, help="chats per mode (default 32)")
    p.add_argument("--gap", type=float, default=2.5, help="mean seconds between arrivals (default 2.5)")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens generated per chat (default 64)")
    p.add_argument("--systems", type=int, default=3, help="shared system prompts (default 3)")
    p.add_argument(
        "--note-words", type=int, nargs=2, default=[150, 720], help="words of each chat's note (min max)"
    )
    p.add_argument(
        "--kv-blocks", type=int, default=512, help="KV blocks of 16 tokens per daemon (default 512)"
    )
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument(
        "--modes", default=",".join(MODES), help="a comma-separated subset of: " + ", ".join(MODES)
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="a test's size: " + json.dumps(QUICK))
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    if args.quick:
        for key, value in QUICK.items():
            setattr(args, key, value)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not modes or set(modes) - set(MODES):
        p.error(f"--modes: choose from {list(MODES)}")

    work = workload(args)
    load_before = os.getloadavg()
    tmp = Path(tempfile.mkdtemp(prefix="kvpilot-bench-disagg-"))
    (tmp / "token").write_text(TOKEN + "\n")
    runs = {}
    for mode in modes:
        print(f"--- {mode}", flush=True)
        runs[mode] = run_mode(mode, work, args, tmp)
        r = runs[mode]
        print(
            f"{mode:9s} ITL p50 {r['itl_p50_ms']:7.1f} ms  p99 {r['itl_p99_ms']:7.1f} ms  "
            f"TTFT p50 {r['ttft_p50_ms']:7.0f} ms  p99 {r['ttft_p99_ms']:7.0f} ms  "
            f"{r['output_tokens_per_s']} tok/s  errors {r['errors']}",
            flush=True,
        )
        if "kv_transfer" in r:
            kv = r["kv_transfer"]
            ref = kv.get("socket_copy") or {}
            print(
                f"{'':9s} KV transfer {kv['bandwidth_gbit_s']} Gbit/s over {kv['pulls']} pulls "
                f"({kv['bytes_received'] / 2**20:.1f} MiB) vs a loopback socket copy {ref.get('bandwidth_gbit_s')} "
                f"Gbit/s ({kv.get('bandwidth_over_socket_copy')}x); {kv['blocks_reused_on_decode_pod']} of "
                f"{kv['held_blocks']} held blocks not pulled (decode-side reuse)",
                flush=True,
            )

    doc = benchkit.header("disagg", load_before) | {"git": benchkit.git_head(), "model": MODEL}
    doc["config"] = {k: v for k, v in vars(args).items() if k != "out"} | {"block_size": BLOCK}
    doc["workload"] = {
        "requests": len(work),
        "arrivals": "open loop, exponential gaps",
        "last_arrival_s": work[-1]["at"] if work else 0,
        "system_prompts": args.systems,
        "max_tokens": args.max_tokens,
    }
    doc["runs"] = runs
    if {"colocated", "pd"} <= set(runs):
        c, d = runs["colocated"], runs["pd"]
        doc["ratios"] = {
            "itl_p50_colocated_over_pd": ratio(c["itl_p50_ms"], d["itl_p50_ms"]),
            "itl_p99_colocated_over_pd": ratio(c["itl_p99_ms"], d["itl_p99_ms"]),
            "ttft_p50_pd_over_colocated": ratio(d["ttft_p50_ms"], c["ttft_p50_ms"]),
            "ttft_p99_pd_over_colocated": ratio(d["ttft_p99_ms"], c["ttft_p99_ms"]),
            "output_tokens_per_s_pd_over_colocated": ratio(
                d["output_tokens_per_s"], c["output_tokens_per_s"]
            ),
            "kv_transfer_over_socket_copy": d["kv_transfer"].get("bandwidth_over_socket_copy"),
        }
        print(json.dumps(doc["ratios"]))
    benchkit.write(
        args.out or benchkit.default_path(ROOT / "bench" / "results", "disagg"), doc, f" (logs in {tmp})"
    )
    return 1 if any(r["errors"] for r in runs.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
