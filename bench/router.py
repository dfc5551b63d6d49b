"""Router benchmark: prefix-aware vs round-robin over the same two daemons, and staleness after a reset.

Workload: several shared system prompts x many users (chat, streamed, greedy, a few tokens each), sent
by a few concurrent clients in a shuffled order. Each daemon's KV pool holds about half of the system
prompts, so a router that scatters them (round-robin) makes each pod evict what the other pod's traffic
brought in, while one that routes by cached prefix (prefix-aware) lets each pod keep its share.

Both policies run in the same process against the same daemons; each run starts from a fleet reset
through its router (cold caches). Per policy: the fleet's prefix hit rate (cached / prompt tokens, from
`usage`), TTFT p50/p99, requests per pod, and for prefix-aware the predicted vs reported cached tokens.
Then one probe (every system prompt once, at once) goes through the warm prefix-aware router just before
and right after a fleet reset through it: before, the index predicts the cached prefixes; after, any
prediction from a block the reset made unreachable shows up as `stale_predictions` (must be 0).

Then the same workload on one `--data-parallel-size 2` daemon (each rank with the KV blocks of one daemon
above): through the prefix-aware router, which reads each rank's KV events and names the rank
(`X-data-parallel-rank`), vs sent to the daemon directly, whose own policy guesses the rank from the
prefixes it sent there (`dp_policy.py`). Each run starts from a reset.

    .venv/bin/python bench/router.py                  # 8 prompts x 6 users, 4 clients, 2 daemons, 2 repeats
    .venv/bin/python bench/router.py --prompts 8 --users 16 --concurrency 8
    .venv/bin/python bench/router.py --prompts 4 --users 3 --repeats 1   # a quick look

Results go to bench/results/router.json.
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
from pathlib import Path

import aiohttp

sys.path.append(str(Path(__file__).resolve().parents[1] / "hack" / "lib"))  # benchkit, devcluster

import benchkit
from devcluster.procs import free_port
from kvpilot.cli.loadgen import pct

ROOT = Path(__file__).resolve().parent.parent

MODEL = "SmolLM2-135M-Instruct"
TOKEN = "bench-router-token"
SHOPS = [
    "Northwind bikes",
    "Harbour books",
    "Alpine outfitters",
    "Lakeside bakery",
    "Metro phones",
    "Green garden centre",
    "Riverside pharmacy",
    "Old town florist",
]
QUESTIONS = [
    "When do you open?",
    "Can I pay by card?",
    "Do you deliver?",
    "Is there parking?",
    "Do you have a loyalty card?",
    "Can I return an item?",
    "Are you open on Sunday?",
    "Do you sell gift cards?",
    "Where are you located?",
    "Can I order by phone?",
    "Do you offer discounts for students?",
    "How long does delivery take?",
    "Do you have a website?",
    "Can I reserve an item?",
    "Do you repair things?",
    "Is the shop accessible by wheelchair?",
]


def system_prompt(shop: str) -> str:
    return (
        f"You are the assistant of {shop}. Answer in one short, polite sentence and never invent "
        f"facts. {shop} opens at nine and closes at six on weekdays, opens at ten on Saturdays and is "
        f"closed on Sundays. {shop} accepts cards and cash, delivers within the city for five euros, "
        f"has a loyalty card with a ten percent discount after ten visits, and takes returns within "
        f"thirty days with a receipt. Parking is free behind the building of {shop}. Gift cards of "
        f"twenty, fifty and one hundred euros are sold at the counter of {shop}, students get five "
        f"percent off with a valid card, orders by phone are taken until five, and reserved items are "
        f"kept for three days. The shop is accessible by wheelchair through the side entrance, and "
        f"the staff of {shop} speak English, French and German."
    )


# ---- processes -----------------------------------------------------------------------------------
def launch(args: list[str], log: Path, url: str) -> subprocess.Popen:
    """`python -m kvpilot ARGS`, ready once /health answers with every pod's KV events synced."""

    def synced(health: dict) -> bool:
        return all(p.get("synced", True) for p in health.get("pods", []))

    return benchkit.launch([sys.executable, "-m", "kvpilot", *args], log, url, 600, ready=synced)


async def run_load(url: str, work: list[tuple[str, str]], concurrency: int, max_tokens: int) -> list[dict]:
    return await benchkit.run_load(
        work, concurrency, lambda s, w: benchkit.stream_chat(s, url, MODEL, w[0], w[1], max_tokens)
    )


async def fleet_reset(url: str) -> dict:
    async with aiohttp.ClientSession() as session:
        async with session.post(
            url + "/reset_prefix_cache", headers={"Authorization": f"Bearer {TOKEN}"}
        ) as r:
            body = await r.json()
            if r.status != 200:
                raise RuntimeError(f"fleet reset failed: {body}")
            return body


def router_metrics(url: str) -> dict[str, float]:
    return {k: v for k, v in benchkit.metrics(url).items() if k.startswith("kvpilot_router_")}


def total(metrics: dict[str, float], name: str, label: str = "") -> float:
    """Sum of a metric's samples over its labels (those containing `label`)."""
    name = "kvpilot_router_" + name
    return sum(v for k, v in metrics.items() if k.split("{")[0] == name and label in k)


def summarize(results: list[dict]) -> dict:
    ok = [r for r in results if "error" not in r]
    prompt = sum(r["prompt_tokens"] for r in ok)
    pods: dict[str, int] = {}
    for r in ok:
        pods[r["pod"]] = pods.get(r["pod"], 0) + 1
    return {
        "requests": len(results),
        "errors": len(results) - len(ok),
        "prefix_hit_rate": sum(r["cached_tokens"] for r in ok) / prompt if prompt else None,
        "cold_requests": sum(1 for r in ok if not r["cached_tokens"]),  # no prefix cached: computed whole
        "ttft_p50_ms": pct([r["ttft"] for r in ok], 50) * 1e3,
        "ttft_p99_ms": pct([r["ttft"] for r in ok], 99) * 1e3,
        "ttft_mean_ms": statistics.fmean(r["ttft"] for r in ok) * 1e3 if ok else None,
        "requests_per_pod": pods,
    }


def delta(after: dict, before: dict, name: str) -> float:
    return total(after, name) - total(before, name)


def workload(args: argparse.Namespace, work: list[tuple[str, str]]) -> dict:
    """The load of a run as its JSON names it (this bench's flags; bench/endpoint_picker.py and
    bench/router_compare.py send the same load)."""
    return {
        "system_prompts": args.prompts,
        "users_per_prompt": args.users,
        "requests": len(work),
        "concurrency": args.concurrency,
        "max_tokens": args.max_tokens,
        "kv_blocks_per_daemon": args.kv_blocks,
        "repeats": args.repeats,
        "seed": args.seed,
    }


def start_daemon(
    kv_blocks: int, token_file: Path, log: Path, events: int, replay: int, *extra: str
) -> tuple[subprocess.Popen, str]:
    """A `kvpilot serve` publishing KV events on `events` (replay on `replay`); returns it and its URL."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    args = ["serve", "--host", "127.0.0.1", "--port", str(port), "--num-gpu-blocks-override", str(kv_blocks)]
    args += ["--max-num-seqs", "8", "--admin-token-file", str(token_file), *extra]
    args += ["--kv-events-endpoint", f"tcp://127.0.0.1:{events}"]
    args += ["--kv-events-replay-endpoint", f"tcp://127.0.0.1:{replay}"]
    return launch(args, log, url), url


def start_router(
    policy: str, endpoints: list[str], token_file: Path, log: Path
) -> tuple[subprocess.Popen, str]:
    """A `kvpilot router` in front of `endpoints`; returns it and its URL."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    args = ["router", "--host", "127.0.0.1", "--port", str(port), "--policy", policy]
    args += ["--endpoints", ",".join(endpoints), "--admin-token-file", str(token_file)]
    return launch(args, log, url), url


async def direct_reset(url: str) -> None:
    async with aiohttp.ClientSession() as session:
        async with session.post(
            url + "/reset_prefix_cache", headers={"Authorization": f"Bearer {TOKEN}"}
        ) as r:
            if r.status != 200:
                raise RuntimeError(f"reset failed: {await r.text()}")


def data_parallel_runs(
    args: argparse.Namespace,
    work: list[tuple[str, str]],
    logdir: Path,
    token_file: Path,
    procs: list[subprocess.Popen],
) -> dict:
    """One DP=2 daemon: the router's exact per-rank routing vs the daemon's own choice of rank."""
    events = free_port()
    # Rank r publishes on port + r: the replay sockets start past rank 1's events port.
    proc, daemon = start_daemon(
        args.kv_blocks, token_file, logdir / "daemon-dp2.log", events, events + 2, "--data-parallel-size", "2"
    )
    procs.append(proc)
    proc, router = start_router("prefix-aware", [daemon], token_file, logdir / "router-dp2.log")
    procs.append(proc)
    asyncio.run(run_load(daemon, work[:2], 2, 2))  # warm-up
    modes = {"router-per-rank": router, "daemon-choice": daemon}
    runs = []
    order = [("daemon-choice", "router-per-rank"), ("router-per-rank", "daemon-choice")]
    for rep in range(args.repeats):
        for mode in order[rep % 2]:
            url = modes[mode]
            asyncio.run(fleet_reset(url) if url == router else direct_reset(url))
            start = time.perf_counter()
            results = asyncio.run(run_load(url, work, args.concurrency, args.max_tokens))
            run = {"mode": mode, "repeat": rep} | summarize(results) | {"wall_s": time.perf_counter() - start}
            del run["requests_per_pod"]  # one pod
            runs.append(run)
            print(
                f"DP=2 {mode:15s} hit {run['prefix_hit_rate']:.3f}  TTFT p50 {run['ttft_p50_ms']:7.0f} ms  "
                f"p99 {run['ttft_p99_ms']:7.0f} ms  {run['wall_s']:.1f} s",
                flush=True,
            )
    summary = {}
    for mode in modes:
        mine = [r for r in runs if r["mode"] == mode]
        summary[mode] = {
            "prefix_hit_rate": statistics.fmean(r["prefix_hit_rate"] for r in mine),
            "ttft_p50_ms": statistics.median(r["ttft_p50_ms"] for r in mine),
            "errors": sum(r["errors"] for r in mine),
        }
    return {"kv_blocks_per_rank": args.kv_blocks, "summary": summary, "runs": runs}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompts", type=int, default=8, help="shared system prompts (default 8)")
    p.add_argument("--users", type=int, default=6, help="users per system prompt (default 6)")
    p.add_argument("--concurrency", type=int, default=4, help="concurrent clients (default 4)")
    p.add_argument("--max-tokens", type=int, default=4, help="tokens generated per request (default 4)")
    p.add_argument(
        "--kv-blocks",
        type=int,
        default=64,
        help="KV blocks per daemon (default 64: about half the system prompts fit)",
    )
    p.add_argument("--repeats", type=int, default=2, help="runs per policy, alternating (default 2)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output", default=str(ROOT / "bench" / "results" / "router.json"))
    args = p.parse_args()

    rng = random.Random(args.seed)
    systems = [
        system_prompt(SHOPS[i % len(SHOPS)] + (f" {i // len(SHOPS) + 1}" if i >= len(SHOPS) else ""))
        for i in range(args.prompts)
    ]
    work = [
        (s, QUESTIONS[u % len(QUESTIONS)] + (f" ({u})" if u >= len(QUESTIONS) else ""))
        for s in systems
        for u in range(args.users)
    ]
    rng.shuffle(work)

    logdir = Path(tempfile.mkdtemp(prefix="bench-router-"))
    token_file = logdir / "token"
    token_file.write_text(TOKEN)
    procs: list[subprocess.Popen] = []
    try:
        daemons = []
        for i in range(2):
            proc, url = start_daemon(
                args.kv_blocks, token_file, logdir / f"daemon-{i}.log", free_port(), free_port()
            )
            procs.append(proc)
            daemons.append(url)
        routers = {}
        for policy in ("round-robin", "prefix-aware"):
            proc, routers[policy] = start_router(policy, daemons, token_file, logdir / f"router-{policy}.log")
            procs.append(proc)
        # Warm-up (first-call costs), then cold caches for every measured run.
        asyncio.run(run_load(routers["round-robin"], work[:2], 2, 2))

        # Alternate the policies (RR PA PA RR ...) so that drift in the machine's load hits both alike.
        runs: list[dict] = []
        order = [("round-robin", "prefix-aware"), ("prefix-aware", "round-robin")]
        for rep in range(args.repeats):
            for policy in order[rep % 2]:
                url = routers[policy]
                asyncio.run(fleet_reset(url))
                before = router_metrics(url)
                start = time.perf_counter()
                results = asyncio.run(run_load(url, work, args.concurrency, args.max_tokens))
                wall = time.perf_counter() - start
                after = router_metrics(url)
                run = {"policy": policy, "repeat": rep} | summarize(results) | {"wall_s": wall}
                run["predicted_cached_tokens"] = delta(after, before, "predicted_cached_tokens_total")
                run["reported_cached_tokens"] = delta(after, before, "reported_cached_tokens_total")
                run["stale_predictions"] = delta(after, before, "stale_predictions_total")
                runs.append(run)
                print(
                    f"{policy:13s} hit {run['prefix_hit_rate']:.3f}  TTFT p50 {run['ttft_p50_ms']:7.0f} ms  "
                    f"p99 {run['ttft_p99_ms']:7.0f} ms  pods {run['requests_per_pod']}  {wall:.1f} s",
                    flush=True,
                )

        # The same probe (every system prompt once, all at once) through the warm prefix-aware router,
        # just before and right after a fleet reset through it: before, the index predicts the cached
        # prefixes; after, a prediction from a block the reset made unreachable would be stale.
        url = routers["prefix-aware"]
        probe = [(s, "Hello?") for s in systems]

        def probe_predictions() -> dict:
            before = router_metrics(url)
            results = asyncio.run(run_load(url, probe, len(probe), 2))
            after = router_metrics(url)
            return {
                "requests": len(results),
                "errors": sum(1 for r in results if "error" in r),
                "predicted_cached_tokens": delta(after, before, "predicted_cached_tokens_total"),
                "reported_cached_tokens": delta(after, before, "reported_cached_tokens_total"),
                "stale_predictions": delta(after, before, "stale_predictions_total"),
            }

        before_reset = probe_predictions()
        reset_reply = asyncio.run(fleet_reset(url))
        stale = probe_predictions() | {
            "reset_epochs": {p["pod"]: p["epoch"] for p in reset_reply["pods"]},
            "same_probe_before_reset": before_reset,
        }
        print(f"after reset: {stale}", flush=True)
        events = router_metrics(url)
        per_policy = {}
        for policy in ("prefix-aware", "round-robin"):
            mine = [r for r in runs if r["policy"] == policy]
            per_policy[policy] = {
                "prefix_hit_rate": statistics.fmean(r["prefix_hit_rate"] for r in mine),
                "ttft_p50_ms": statistics.median(r["ttft_p50_ms"] for r in mine),
                "ttft_p99_ms": statistics.median(r["ttft_p99_ms"] for r in mine),
                "errors": sum(r["errors"] for r in mine),
            }
        pa, rr = per_policy["prefix-aware"], per_policy["round-robin"]
        print(
            f"prefix-aware vs round-robin: hit {pa['prefix_hit_rate']:.3f} vs {rr['prefix_hit_rate']:.3f}, "
            f"TTFT p50 {pa['ttft_p50_ms']:.0f} vs {rr['ttft_p50_ms']:.0f} ms (median of {args.repeats} runs "
            f"each); stale predictions after the reset: {stale['stale_predictions']:.0f}"
        )
        for proc in procs:
            benchkit.shutdown(proc)  # free the CPUs for the data-parallel daemon
        procs.clear()
        dp = data_parallel_runs(args, work, logdir, token_file, procs)
        exact, own = dp["summary"]["router-per-rank"], dp["summary"]["daemon-choice"]
        print(
            f"DP=2 pod: hit {exact['prefix_hit_rate']:.3f} with the router's per-rank routing vs "
            f"{own['prefix_hit_rate']:.3f} with the daemon's own choice",
            flush=True,
        )
        doc = {
            "bench": "router",
            "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "machine": f"{os.cpu_count()} CPUs, shared with other work (load average "
            f"{os.getloadavg()[0]:.1f} at the end)",
            "model": MODEL,
            "daemons": 2,
            "workload": workload(args, work),
            "summary": per_policy,
            "prefix_aware_vs_round_robin": {
                "hit_rate": [pa["prefix_hit_rate"], rr["prefix_hit_rate"]],
                "ttft_p50_ratio": pa["ttft_p50_ms"] / rr["ttft_p50_ms"],
            },
            "after_fleet_reset": stale,
            "data_parallel_pod": dp,
            "kv_event_batches": {
                r: total(events, "kv_event_batches_total", f'result="{r}"')
                for r in ("received", "replayed", "missed")
            },
            "runs": runs,
        }
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output).write_text(json.dumps(doc, indent=2) + "\n")
        print(f"wrote {args.output}")
        errors = rr["errors"] + pa["errors"] + exact["errors"] + own["errors"]
        return 0 if stale["stale_predictions"] == 0 and not errors else 1
    finally:
        for proc in reversed(procs):
            benchkit.shutdown(proc)


if __name__ == "__main__":
    sys.exit(main())
