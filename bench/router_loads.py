"""kvpilot's prefix-aware router against the real `sglang-router` (`--policy cache_aware`) on a family of
generated loads: is the policy right on loads it was not tuned on?

Each member of the family is drawn from `--seed`: the pod count (2-4), each pod's pool (48-512 blocks of
16 tokens), the number of shared system prompts (2-24) and their lengths (64-640 tokens), the share of
requests that reuse one of them (0.3-0.95, by a Zipf popularity; the rest bring a one-off system prompt),
the concurrency (2-12), and 0-2 flushes (a pod's cache reset directly, behind the router's back) and 0-1
restarts (a pod's cache lost as a restarted daemon loses it) at random requests. Every request is a chat
(its system prompt, then a user line never sent before), not streamed.

The pods are bench/stub_pods.py's: each keeps a prefix cache as a kvpilot daemon does (LRU blocks keyed as
the daemon keys them), publishes its KV events, answers with `cached_tokens`, and takes
`--prefill-us-per-token` per prompt token it did not have cached, one prompt at a time, before it answers:
so a request's latency is its time to first token, and it depends on where the router sent it and what
else that pod was computing. Each router in turn fronts the same pods, cold (reset) before its run, and
gets the same requests with the same flushes and restarts at the same request numbers. Figures per member
and router: the hit share (cached prompt tokens over prompt tokens, from the pods' replies), TTFT p50 and
mean, and failures; `summary` counts the members where kvpilot's hit share and TTFT p50 are at least as
good as sglang-router's (the median of each router's runs), and those where kvpilot trails by more than the
member's noise: the widest spread, over the median, of either router's own runs of it (`--repeats` 2 or
more). A member's figures move by several percent from run to run, so a single comparison at a margin
under that decides nothing; the geometric mean of the ratios over the members says where kvpilot stands
on the whole.

    .venv/bin/python bench/router_loads.py                      # 8 members, 300 requests, 2 runs each
    .venv/bin/python bench/router_loads.py --members 2 --requests 60 --repeats 1   # a quick look

`sglang-router` comes from `make sglang-router` (~/.cache/kvpilot/tools/bin). Results go to
bench/results/router-loads-<UTC time>.json (--out to choose).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import tempfile
import time
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path

import aiohttp

sys.path.append(str(Path(__file__).resolve().parents[1] / "hack" / "lib"))  # benchkit, devcluster
sys.path.append(str(Path(__file__).resolve().parent))  # the other benches (after site-packages)

from router_cost import start_kvpilot, start_sglang
from stub_pods import MODEL, start_stub_pods

import benchkit

ROOT = Path(__file__).resolve().parent.parent
WORDS = (
    "account adapter archive billing buffer cache cluster console contract customer deploy device driver "
    "engine export firmware gateway invoice kernel ledger license mirror module network order package "
    "payment pipeline policy portal printer quota refund region release replica report router schedule "
    "search server shipping storage support ticket token upgrade vendor volume warranty window"
).split()


@dataclass
class Member:
    """One generated load."""

    seed: int
    pods: int
    blocks: int
    prefixes: int
    prefix_words: list[int]
    repeat_share: float
    concurrency: int
    requests: int
    # request number -> (what happens to which pod before it is sent: "flush" or "restart", pod index)
    events: dict[int, tuple[str, int]] = field(default_factory=dict)


def draw(seed: int, requests: int) -> Member:
    rng = random.Random(seed)
    prefixes = rng.randint(2, 24)
    events: dict[int, tuple[str, int]] = {}
    pods = rng.randint(2, 4)
    for kind, count in (("flush", rng.randint(0, 2)), ("restart", rng.randint(0, 1))):
        for _ in range(count):
            events[rng.randrange(requests // 5, requests)] = (kind, rng.randrange(pods))
    return Member(
        seed=seed,
        pods=pods,
        blocks=rng.choice((48, 64, 96, 128, 192, 256, 384, 512)),
        prefixes=prefixes,
        # ~1.3 tokens a word: 64-640 tokens
        prefix_words=[rng.randint(48, 480) for _ in range(prefixes)],
        repeat_share=round(rng.uniform(0.3, 0.95), 2),
        concurrency=rng.randint(2, 12),
        requests=requests,
        events=dict(sorted(events.items())),
    )


def _text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


def bodies(m: Member) -> list[bytes]:
    """The member's requests, in order: the same for every router."""
    rng = random.Random(m.seed * 7919 + 1)
    systems = [f"You are helper {i}. " + _text(rng, n) for i, n in enumerate(m.prefix_words)]
    weights = [1 / (rank + 1) for rank in range(m.prefixes)]  # Zipf: a few hot prompts, a long tail
    out = []
    for i in range(m.requests):
        if rng.random() < m.repeat_share:
            system = rng.choices(systems, weights)[0]
        else:
            system = f"You are a one-off helper {i}. " + _text(rng, rng.randint(48, 480))
        user = f"Question {i}: " + _text(rng, rng.randint(4, 24)) + "?"
        doc = {
            "model": MODEL,
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}],
            "max_tokens": 4,
            "temperature": 0,
        }
        out.append(json.dumps(doc).encode())
    return out


def _post(url: str) -> None:
    with urllib.request.urlopen(urllib.request.Request(url, method="POST"), timeout=30) as r:
        r.read()


async def _run_load(url: str, pods: list[str], m: Member, requests: list[bytes]) -> dict:
    """Send the member's requests through `url`, `m.concurrency` in flight, doing each flush or restart
    just before its request is sent; the pods' usage and each request's time."""
    headers = {"Content-Type": "application/json"}
    nxt = [0]
    prompt_tokens, cached_tokens, ttft, failures = [0], [0], [], [0]
    loop = asyncio.get_running_loop()
    timeout = aiohttp.ClientTimeout(total=300)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as s:

        async def client() -> None:
            while nxt[0] < len(requests):
                i = nxt[0]
                nxt[0] += 1
                if i in m.events:
                    kind, pod = m.events[i]
                    path = "/reset_prefix_cache" if kind == "flush" else "/stub/restart"
                    await loop.run_in_executor(None, _post, pods[pod] + path)
                t0 = time.perf_counter()
                async with s.post(url + "/v1/chat/completions", data=requests[i], headers=headers) as r:
                    raw = await r.read()
                    took = time.perf_counter() - t0
                    if r.status != 200:
                        failures[0] += 1
                        continue
                usage = json.loads(raw)["usage"]
                ttft.append(took)
                prompt_tokens[0] += usage["prompt_tokens"]
                cached_tokens[0] += usage["prompt_tokens_details"]["cached_tokens"]

        t0 = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(m.concurrency)))
        wall = time.perf_counter() - t0
    return {
        "hit_share": round(cached_tokens[0] / max(prompt_tokens[0], 1), 4),
        "ttft_p50_ms": round(statistics.median(ttft) * 1e3, 1) if ttft else None,
        "ttft_mean_ms": round(statistics.fmean(ttft) * 1e3, 1) if ttft else None,
        "prompt_tokens": prompt_tokens[0],
        "cached_tokens": cached_tokens[0],
        "failures": failures[0],
        "wall_s": round(wall, 2),
    }


ROUTERS = ("kvpilot", "sglang-router")


def run_member(m: Member, args: argparse.Namespace, binary: str, tmp: Path) -> dict:
    stub_procs, pods = start_stub_pods(
        m.pods, tmp, kv_events=True, blocks=m.blocks, prefill_us_per_token=args.prefill_us_per_token
    )
    requests = bodies(m)
    out: dict = {"member": asdict(m) | {"events": [[i, *e] for i, e in m.events.items()]}}
    try:
        for _ in range(args.repeats):
            for name in ROUTERS:
                for pod in pods:  # cold caches for each router
                    _post(pod + "/reset_prefix_cache")
                if name == "kvpilot":
                    proc, url = start_kvpilot(pods, tmp, "prefix-aware")
                else:
                    proc, url = start_sglang(binary, pods, tmp, "cache_aware")
                try:
                    got = asyncio.run(_run_load(url, pods, m, requests))
                finally:
                    benchkit.shutdown(proc)
                print(f"member {m.seed} {name:14s} {json.dumps(got)}", flush=True)
                if got["ttft_p50_ms"] is None:  # nothing to compare: say so, not a TypeError further down
                    raise SystemExit(
                        f"{name} answered none of member {m.seed}'s requests: its log is in {tmp}"
                    )
                out.setdefault(name, []).append(got)
    finally:
        for p in stub_procs:
            benchkit.shutdown(p)
    for name in ROUTERS:  # the median run of each router
        runs = out[name]
        out[name + "_median"] = {
            k: statistics.median(r[k] for r in runs)
            for k in ("hit_share", "ttft_p50_ms", "ttft_mean_ms", "failures")
        }
    k, s = out["kvpilot_median"], out["sglang-router_median"]
    out["kvpilot_hit_at_least"] = k["hit_share"] >= s["hit_share"]
    out["kvpilot_ttft_at_most"] = k["ttft_p50_ms"] <= s["ttft_p50_ms"]
    out["hit_share_ratio"] = round(k["hit_share"] / s["hit_share"], 3) if s["hit_share"] else None
    out["ttft_p50_ratio"] = round(k["ttft_p50_ms"] / s["ttft_p50_ms"], 3) if s["ttft_p50_ms"] else None
    # Behind by more than the member's own noise: the widest spread of either router's runs, relative to
    # its median (None with one run each: no noise to compare with).
    for label, metric, sign in (("hit_share", "hit_share", -1), ("ttft_p50", "ttft_p50_ms", 1)):
        noise, ratio = _spread(out, metric), out[label + "_ratio"]
        out[label + "_noise"] = noise
        # (rounded as both are: 1.03 - 1 is a hair over 0.03 in floats, and a tie is not beyond noise)
        behind = None if noise is None or ratio is None else round(sign * (ratio - 1), 3) > noise
        out[f"kvpilot_{label}_behind_beyond_noise"] = behind
    return out


def _spread(out: dict, metric: str) -> float | None:
    """The widest relative spread, (max - min) / median, of `metric` over each router's runs of a member
    (over the largest where the median is 0); None without two runs of each."""
    spreads = []
    for name in ROUTERS:
        values = [r[metric] for r in out[name]]  # (a run without a TTFT ended the bench: run_member)
        if len(values) < 2:
            return None
        scale = statistics.median(values) or max(values)
        spreads.append((max(values) - min(values)) / scale if scale else 0.0)
    return round(max(spreads), 3)


def _geomean(ratios: list[float | None]) -> float | None:
    """Over the members, how far kvpilot is from sglang-router on the whole (1: level); 0 if it is 0 on one."""
    known = [r for r in ratios if r is not None]
    if not known:
        return None
    return round(statistics.geometric_mean(known), 4) if all(known) else 0.0


def _behind(members: list[dict], label: str) -> int | None:
    """The members where kvpilot trails beyond noise on `label`; None where no member has a noise figure
    (one run of each router)."""
    flags = [m[f"kvpilot_{label}_behind_beyond_noise"] for m in members]
    return None if all(f is None for f in flags) else sum(bool(f) for f in flags)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--members", type=int, default=8, help="generated loads (default 8)")
    ap.add_argument("--seed", type=int, default=46, help="the first member's seed; the rest follow it")
    ap.add_argument("--requests", type=int, default=300, help="chats per member")
    ap.add_argument(
        "--repeats",
        type=int,
        default=2,
        help="runs of each router per member (the median; 2+: a noise figure)",
    )
    ap.add_argument("--prefill-us-per-token", type=float, default=100.0, help="the stub pods' prefill")
    ap.add_argument("--sglang-router", default=None, help="its binary (default: make tools-bindir's)")
    ap.add_argument("--label", default="", help="a note kept in the JSON (e.g. before/after)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    if args.repeats < 1 or args.members < 1 or args.requests < 1:
        ap.error("--repeats, --members and --requests take 1 or more")

    load_before = os.getloadavg()
    binary = args.sglang_router or benchkit.tools_bin("sglang-router")
    tmp = Path(tempfile.mkdtemp(prefix="router-loads-"))
    members = [run_member(draw(args.seed + i, args.requests), args, binary, tmp) for i in range(args.members)]
    summary = {
        "members": len(members),
        "kvpilot_hit_share_at_least_sglang": sum(m["kvpilot_hit_at_least"] for m in members),
        "kvpilot_ttft_p50_at_most_sglang": sum(m["kvpilot_ttft_at_most"] for m in members),
        "hit_share_ratios": [m["hit_share_ratio"] for m in members],
        "ttft_p50_ratios": [m["ttft_p50_ratio"] for m in members],
        "hit_share_ratio_geomean": _geomean([m["hit_share_ratio"] for m in members]),
        "ttft_p50_ratio_geomean": _geomean([m["ttft_p50_ratio"] for m in members]),
        # members where kvpilot trails by more than the member's run-to-run spread (with --repeats >= 2)
        "kvpilot_hit_share_behind_beyond_noise": _behind(members, "hit_share"),
        "kvpilot_ttft_p50_behind_beyond_noise": _behind(members, "ttft_p50"),
    }
    doc = benchkit.header("router_loads", load_before)
    doc |= {"label": args.label, "git": benchkit.git_head(), "args": vars(args) | {"out": None}}
    doc |= {"summary": summary, "members": members}
    doc["args"]["sglang_router"] = binary
    print(json.dumps(summary, indent=2))
    benchkit.write(args.out or benchkit.default_path(ROOT / "bench" / "results", "router-loads"), doc)


if __name__ == "__main__":
    main()
