"""Pinned prefixes and the eviction policies: what each keeps warm under a load that evicts.

1. **A pinned system prompt under an evicting load** (a `kvpilot serve` over HTTP, `--enable-pinned-prefix`,
   a small pool): a long system prompt is sent once, then each round a burst of one-off prompts larger than
   the pool runs, then one request of the system prompt with a new question: its time to first token
   (streamed) and cached tokens. Once with the system prompt unpinned (the baseline), once pinned
   (`pin_prefix: true` on its first send), in one server, a reset between them.
2. **Each policy's hit share on a skewed load** (the engine in-process, the embedded model): a few hot system
   prompts (requested by a Zipf law, each with its own question) mixed with one-off prompts, in one seeded
   order, replayed under `--prefix-cache-eviction-policy lru` and `lfu`: the prompt tokens served from cache
   over those looked up.

One JSON file under bench/results/ with both, and the ratios (unpinned / pinned TTFT, LFU / LRU hit share).

    PYTHONSAFEPATH=1 python bench/pinned_prefix.py            # 5 rounds; 240 requests on the skewed load
    PYTHONSAFEPATH=1 python bench/pinned_prefix.py --quick    # 2 rounds; 80 requests
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parents[1] / "hack" / "lib"))  # benchkit
import benchkit  # noqa: E402
from kvpilot.daemon.engine.config import EngineConfig  # noqa: E402
from kvpilot.daemon.engine.engine import LLMEngine  # noqa: E402
from kvpilot.daemon.engine.request import SamplingParams  # noqa: E402

RESULTS = Path(__file__).parent / "results"
SYSTEM = (
    "You are the support assistant of the harbour museum. Answer questions about its lighthouse, its ships, "
    "its opening hours and its tickets. Be brief, friendly and exact; never invent an exhibit. "
) * 8  # about 330 tokens: 20 blocks


def post(url: str, body: dict, stream: bool = False) -> tuple[float, dict]:
    """(seconds to the first token, the reply or the last chunk); the first token's time is the first
    streamed chunk's when `stream`, else the whole reply's."""
    if stream:
        body = body | {"stream": True, "stream_options": {"include_usage": True}}
    req = urllib.request.Request(
        url + "/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    start = time.perf_counter()
    first, last = None, {}
    try:
        r = urllib.request.urlopen(req, timeout=600)
    except urllib.error.HTTPError as exc:
        raise SystemExit(f"HTTP {exc.code} from the daemon: {exc.read()[:500]!r}") from None
    with r:
        if not stream:
            return time.perf_counter() - start, json.loads(r.read())
        for raw in r:
            if raw.startswith(b"data: {"):
                chunk = json.loads(raw[6:])
                if first is None and any(c.get("delta", {}).get("content") for c in chunk["choices"]):
                    first = time.perf_counter() - start
                last = chunk
    return first if first is not None else time.perf_counter() - start, last


def chat(system: str, question: str, **extra: object) -> dict:
    messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
    return {"messages": messages, "max_tokens": 2, "temperature": 0, **extra}


def pinned_rounds(url: str, rounds: int, burst: int, pin: bool) -> dict:
    """The system prompt sent once (pinned or not), then `rounds` x (a burst of `burst` one-off prompts, the
    system prompt with a new question)."""
    _, reply = post(url, chat(SYSTEM, "What are the opening hours?", pin_prefix=pin))
    ttfts, cached = [], []
    for r in range(rounds):
        for i in range(burst):
            one_off = f"Visitor {r}-{i} asks: " + " ".join(f"w{r}{i}{k}" for k in range(100))
            post(url, chat("You are a terse assistant.", one_off))
        t, last = post(url, chat(SYSTEM, f"Question {r}: how much is a ticket for a child?"), stream=True)
        ttfts.append(t)
        cached.append(last["usage"]["prompt_tokens_details"]["cached_tokens"])
    return {
        "pin": reply.get("pin_prefix"),
        "system_prompt_tokens": reply["usage"]["prompt_tokens"],
        "ttft_s": [round(t, 4) for t in ttfts],
        "ttft_p50_s": round(statistics.median(ttfts), 4),
        "cached_tokens": cached,
    }


def skewed_load(n: int, seed: int) -> list[list[int]]:
    """`n` prompts (token ids): half of a few hot system prompts (Zipf law: the first the most asked), each
    with a question of its own; half one-off prompts of the same length."""
    rng = random.Random(seed)
    hot = [[rng.randrange(1000, 40000) for _ in range(160)] for _ in range(6)]
    weights = [1 / (k + 1) for k in range(len(hot))]
    out = []
    for _ in range(n):
        question = [rng.randrange(1000, 40000) for _ in range(12)]
        if rng.random() < 0.5:
            out.append(rng.choices(hot, weights)[0] + question)
        else:
            out.append([rng.randrange(1000, 40000) for _ in range(160)] + question)
    return out


def hit_share(policy: str, prompts: list[list[int]], blocks: int) -> dict:
    engine = LLMEngine(
        EngineConfig(num_kv_blocks=blocks, prefix_cache_eviction_policy=policy, max_num_seqs=1)
    )
    start = time.perf_counter()
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, SamplingParams(max_tokens=1))
        while engine.has_unfinished_requests():
            engine.step()
    s = engine.stats()
    return {
        "policy": policy,
        "hit_share": round(s.hit_tokens / s.query_tokens, 4),
        "hit_tokens": s.hit_tokens,
        "query_tokens": s.query_tokens,
        "seconds": round(time.perf_counter() - start, 1),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--burst", type=int, default=6, help="one-off prompts of ~400 tokens per round")
    ap.add_argument(
        "--blocks", type=int, default=96, help="KV blocks of 16 tokens (the daemon's and the engine's)"
    )
    ap.add_argument("--requests", type=int, default=240, help="requests of the skewed load")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--output", type=Path)
    args = ap.parse_args()
    if args.quick:
        args.rounds, args.requests = 2, 80
    load_before = os.getloadavg()
    flags = ["--enable-pinned-prefix", "--pinned-prefix-cap-ratio", "0.5", "--num-gpu-blocks-override"]
    with tempfile.TemporaryDirectory() as tmp:
        with benchkit.kvpilot_serve(Path(tmp) / "serve.log", 300, *flags, str(args.blocks)) as url:
            post(url, chat("Warm-up.", "Hello"))
            unpinned = pinned_rounds(url, args.rounds, args.burst, pin=False)
            print("unpinned:", json.dumps(unpinned), flush=True)
            reset = urllib.request.Request(url + "/reset_prefix_cache", method="POST")  # no admin token here
            urllib.request.urlopen(reset, timeout=60).read()
            pinned = pinned_rounds(url, args.rounds, args.burst, pin=True)
            print("pinned:  ", json.dumps(pinned), flush=True)
    prompts = skewed_load(args.requests, args.seed)
    policies = {p: hit_share(p, prompts, args.blocks) for p in ("lru", "lfu")}
    for p in policies.values():
        print(json.dumps(p), flush=True)
    doc = benchkit.header("pinned_prefix", load_before) | {
        "commit": benchkit.git_head(),
        "config": vars(args) | {"output": None},
        "pinned_system_prompt": {
            "unpinned": unpinned,
            "pinned": pinned,
            "ttft_ratio_unpinned_over_pinned": round(unpinned["ttft_p50_s"] / pinned["ttft_p50_s"], 2),
        },
        "skewed_load": {
            "requests": args.requests,
            "hot_prompts": 6,
            "policies": policies,
            "hit_share_ratio_lfu_over_lru": round(
                policies["lfu"]["hit_share"] / max(policies["lru"]["hit_share"], 1e-9), 2
            ),
        },
    }
    benchkit.write(args.output or benchkit.default_path(RESULTS, "pinned-prefix"), doc)


if __name__ == "__main__":
    main()
