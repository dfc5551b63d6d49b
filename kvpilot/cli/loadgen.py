"""Client-side load generator: a shared-prefix chat load over HTTP, swept over concurrency levels.

Each run can start with a prefix-cache reset (the use case of kvpilot: every run starts cold, then its
requests share a long system prompt), made through `kvpilot.fanout` as a PrefixCacheReset makes it, so
vLLM's and SGLang's resets are called their own way, and, with `verify`, proven cold by a canary
(kvpilot/fanout/verify.py). With a warm set (`Warm`), the reset is followed by a warm-up of those prompts
as a PrefixCacheWarmup makes it (kvpilot/fanout/warmup.py: sent, sent again, verified warm): a run then
starts from a known warm state, and reports beside its hit rate the share of its prompt tokens the warm set
alone covers (its full blocks; the run's own repeats add to it). Per run: TTFT p50/p99, inter-token latency p50/p99,
output tokens/s, requests/s and the prefix-cache hit rate (from `usage.cached_tokens` and, on a
kvpilot daemon, from `/prefix_cache`). Used by `kvpilot bench` (cli/bench.py, which holds the defaults) and by bench/serve.py; it talks to any
OpenAI-compatible server, so the same sweep runs against vLLM, SGLang or transformers.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from dataclasses import dataclass, field
from typing import cast

import aiohttp

from kvpilot.fanout import ResetSettings, Target, run_fanout
from kvpilot.fanout.warmup import WarmPrompt, WarmSettings, expected_hit, run_warmup
from kvpilot.protocol import JSONObject
from kvpilot.serving.capped_read import read_capped
from kvpilot.serving.http_limits import UPSTREAM_IDLE_S

# /prefix_cache and /tokenize of the warm set's prompts (at most 256 KiB of text: ~64k token ids) fit well
# within this; a server past it is broken, not big.
SERVER_REPLY_BYTES = 4 << 20

SYSTEM = (
    "You are the support assistant of a bicycle shop. The shop sells road bikes, mountain bikes, "
    "city bikes and spare parts, repairs any bike within two days, and is open from nine to six on "
    "weekdays. Answer briefly and politely, and never invent prices. "
) * 3
QUESTIONS = [
    "Do you repair electric bikes?",
    "When are you open on Friday?",
    "Can I rent a bike?",
    "What brakes do road bikes use?",
    "Do you sell helmets?",
    "How long does a repair take?",
    "Can you fix a flat tire today?",
    "Which bike is best for a city commute?",
]


@dataclass
class RequestResult:
    ttft: float
    itls: list[float]
    e2e: float
    completion_tokens: int
    prompt_tokens: int
    cached_tokens: int | None
    error: str | None = None


@dataclass
class RunResult:
    server: str
    concurrency: int
    requests: int
    errors: int
    wall_s: float
    output_tokens_per_s: float
    requests_per_s: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    itl_p50_ms: float
    itl_p99_ms: float
    e2e_p50_s: float
    cache_hit_rate_usage: float | None
    cache_hit_rate_engine: float | None
    # The server's reset before the run, as the fan-out reported it: result (Succeeded, Failed,
    # NotSupported), http_status, epoch, cleared, verified (cold, warm, unknown; None: not verified),
    # verify_message, reason (StillWarm), message. None: no reset (--no-reset).
    reset: JSONObject | None = None
    sample_errors: list[str] = field(default_factory=list)
    # The warm-up after the reset (--warm): result, verified (warm, cold, unknown), message, pin. None: none.
    warm: JSONObject | None = None
    # Share of the run's prompt tokens the warm set's full blocks cover; None: no warm set, or not known
    # (a server without /tokenize or a block size).
    warm_predicted_hit_rate: float | None = None


@dataclass(frozen=True, slots=True)
class Warm:
    """A warm set: prompts sent after each reset, before the run, and whether kvpilot pins them."""

    prompts: tuple[WarmPrompt, ...]
    pin: bool = False


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, max(0, round(q / 100 * (len(values) - 1))))]


def _messages(i: int) -> list[JSONObject]:
    """Request i's chat: the shared system prompt and one of the questions, in turn."""
    return [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]},
    ]


async def one_request(
    session: aiohttp.ClientSession, url: str, model: str, i: int, max_tokens: int
) -> RequestResult:
    body = {
        "model": model,
        "messages": _messages(i),
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start = time.perf_counter()
    ttft: float | None = None
    last = start  # set with ttft, and read only once ttft is
    itls: list[float] = []
    usage: JSONObject = {}
    async with session.post(url + "/v1/chat/completions", json=body) as resp:
        if resp.status != 200:
            return RequestResult(0, [], 0, 0, 0, None, f"HTTP {resp.status}: {(await resp.text())[:200]}")
        async for raw in resp.content:
            line = raw.strip()
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            event = json.loads(line[6:])
            if event.get("usage"):
                usage = event["usage"]
            choices = event.get("choices") or []
            if choices and (choices[0].get("delta") or {}).get("content"):
                now = time.perf_counter()
                if ttft is None:
                    ttft = now - start
                else:
                    itls.append(now - last)
                last = now
    end = time.perf_counter()
    details = usage.get("prompt_tokens_details") or {}
    return RequestResult(
        ttft=ttft if ttft is not None else end - start,
        itls=itls,
        e2e=end - start,
        completion_tokens=usage.get("completion_tokens", len(itls) + (ttft is not None)),
        prompt_tokens=usage.get("prompt_tokens", 0),
        cached_tokens=details.get("cached_tokens"),
    )


async def get_json(
    session: aiohttp.ClientSession, method: str, url: str, body: JSONObject | None = None
) -> tuple[int, JSONObject | str]:
    """(status, the reply's JSON) or (status, the start of its text) when it is not JSON or passes
    SERVER_REPLY_BYTES: the server under test is not trusted to answer a bounded body."""
    async with session.request(method, url, json=body) as resp:
        raw = await read_capped(resp, SERVER_REPLY_BYTES)
        if raw is None:
            return resp.status, f"a reply over {SERVER_REPLY_BYTES} bytes"
        text = raw.decode("utf-8", "replace")
        try:
            return resp.status, json.loads(text)
        except ValueError:
            return resp.status, text[:200]


async def reset_server(url: str, headers: dict[str, str], engine: str, verify: bool) -> JSONObject:
    """Reset the server's prefix cache as one fan-out target, with the load's own bearer token; its result
    as RunResult.reset holds it."""
    bearer = headers.get("Authorization", "")
    token = bearer.removeprefix("Bearer ") if bearer.startswith("Bearer ") else None
    settings = ResetSettings(engine=engine, token=token, verify=verify)
    (res,) = await run_fanout([Target(name=url, url=url)], settings)
    return {
        "result": res.result,
        "http_status": res.http_status,
        "epoch": res.epoch,
        "evicted_blocks": res.evicted_blocks,
        "cleared": res.cleared,
        "verified": res.verified,
        "verify_message": res.verify_message,
        "reason": res.reason or None,
        "message": res.message,
        "duration_s": res.duration_s,
    }


async def warm_server(url: str, headers: dict[str, str], engine: str, warm: Warm) -> JSONObject:
    """Warm the server with the warm set as one fan-out target, with the load's own bearer token; its result
    as RunResult.warm holds it."""
    bearer = headers.get("Authorization", "")
    token = bearer.removeprefix("Bearer ") if bearer.startswith("Bearer ") else None
    settings = WarmSettings(engine=engine, token=token, prompts=warm.prompts, pin=warm.pin, timeout_s=300.0)
    (res,) = await run_warmup([Target(name=url, url=url)], settings)
    return {
        "result": res.result,
        "verified": res.verified,
        "message": res.verify_message or res.message,
        "pin": None if res.warm is None or res.warm.pin is None else res.warm.pin.to_dict(),
        "duration_s": res.duration_s,
    }


async def warm_prediction(
    session: aiohttp.ClientSession, url: str, model: str, warm: Warm, n: int
) -> float | None:
    """The share of a run's prompt tokens (its `n` requests) that the warm set's full blocks cover: each
    request's longest token prefix shared with a warm prompt, in whole blocks short of its last token
    (warmup.expected_hit), over all its prompt tokens. None without a block size (kvpilot's /prefix_cache)
    or token ids (POST /tokenize)."""
    status, info = await get_json(session, "GET", url + "/prefix_cache")
    block = info.get("block_size") if status == 200 and isinstance(info, dict) else None
    if not isinstance(block, int) or block < 1:
        return None

    async def tokens(body: JSONObject) -> list[int] | None:
        status, reply = await get_json(session, "POST", url + "/tokenize", {"model": model, **body})
        ids = reply.get("tokens") if status == 200 and isinstance(reply, dict) else None
        return ids if isinstance(ids, list) else None

    warmed = []
    for p in warm.prompts:
        body = p.body(model, False)
        ids = await tokens({k: v for k, v in body.items() if k in ("messages", "prompt")})
        if ids is None:
            return None
        warmed.append(ids)
    covered = total = 0
    for q in range(min(n, len(QUESTIONS))):
        ids = await tokens({"messages": _messages(q)})
        if ids is None:
            return None
        shared = max((_common_prefix(ids, w) for w in warmed), default=0)
        times = len(range(q, n, len(QUESTIONS)))  # the load sends question q this many times
        covered += times * min(expected_hit(len(ids), block), shared // block * block)
        total += times * len(ids)
    return covered / total if total else None


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


async def run_once(
    url: str,
    model: str,
    server: str,
    concurrency: int,
    n: int,
    max_tokens: int,
    headers: dict[str, str],
    reset: bool = True,
    engine: str = "kvpilot",
    verify: bool = False,
    warm: Warm | None = None,
) -> RunResult:
    timeout = aiohttp.ClientTimeout(total=1800)
    # Idle connections are dropped before the server's own idle close, so no request goes out on a
    # connection the server is closing.
    connector = aiohttp.TCPConnector(keepalive_timeout=UPSTREAM_IDLE_S)
    reset_reply = await reset_server(url, headers, engine, verify) if reset else None
    warm_reply = await warm_server(url, headers, engine, warm) if warm is not None else None
    async with aiohttp.ClientSession(timeout=timeout, headers=headers, connector=connector) as session:
        predicted = await warm_prediction(session, url, model, warm, n) if warm is not None else None
        before = await get_json(session, "GET", url + "/prefix_cache")
        queue: asyncio.Queue[int] = asyncio.Queue()
        for i in range(n):
            queue.put_nowait(i)
        results: list[RequestResult] = []

        async def client() -> None:
            while not queue.empty():
                i = queue.get_nowait()
                try:
                    results.append(await one_request(session, url, model, i, max_tokens))
                except (TimeoutError, aiohttp.ClientError) as exc:
                    results.append(RequestResult(0, [], 0, 0, 0, None, repr(exc)))

        start = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(concurrency)))
        wall = time.perf_counter() - start
        after = await get_json(session, "GET", url + "/prefix_cache")

    ok = [r for r in results if r.error is None]
    tokens = sum(r.completion_tokens for r in ok)
    itls = [x for r in ok for x in r.itls]
    usage_rate = None
    if ok and all(r.cached_tokens is not None for r in ok):
        usage_rate = sum(r.cached_tokens or 0 for r in ok) / max(1, sum(r.prompt_tokens for r in ok))
    engine_rate = None
    old, new = before[1], after[1]
    counters = ("query_tokens", "hit_tokens")
    if all(
        status == 200 and isinstance(d, dict) and all(isinstance(d.get(c), int) for c in counters)
        for status, d in (before, after)
    ):
        # kvpilot's /prefix_cache counters (another server's reply, or a broken one, gives no engine rate)
        old, new = cast(JSONObject, old), cast(JSONObject, new)
        q = new["query_tokens"] - old["query_tokens"]
        engine_rate = (new["hit_tokens"] - old["hit_tokens"]) / q if q else None
    return RunResult(
        server=server,
        concurrency=concurrency,
        requests=len(results),
        errors=len(results) - len(ok),
        wall_s=wall,
        output_tokens_per_s=tokens / wall if wall else 0.0,
        requests_per_s=len(ok) / wall if wall else 0.0,
        ttft_p50_ms=pct([r.ttft for r in ok], 50) * 1e3,
        ttft_p99_ms=pct([r.ttft for r in ok], 99) * 1e3,
        itl_p50_ms=pct(itls, 50) * 1e3,
        itl_p99_ms=pct(itls, 99) * 1e3,
        e2e_p50_s=statistics.median([r.e2e for r in ok]) if ok else float("nan"),
        cache_hit_rate_usage=usage_rate,
        cache_hit_rate_engine=engine_rate,
        reset=reset_reply,
        sample_errors=[r.error for r in results if r.error][:3],
        warm=warm_reply,
        warm_predicted_hit_rate=predicted,
    )


def sweep(
    url: str,
    model: str,
    server: str,
    concurrency: list[int],
    *,
    rounds: int,
    min_requests: int,
    max_tokens: int,
    headers: dict[str, str] | None = None,
    reset: bool = True,
    engine: str = "kvpilot",
    verify: bool = False,
    warm: Warm | None = None,
) -> list[RunResult]:
    """Warm-up (first-call costs: allocator, lazy init), then one run per concurrency level, each
    after a prefix-cache reset of the server (which runs `engine`) unless `reset` is False; with `verify`,
    each reset is proven cold by a canary; with `warm`, each reset is followed by that warm set."""
    headers = headers or {}
    asyncio.run(run_once(url, model, server, 1, 1, 2, headers, reset, engine, verify))
    runs = []
    for c in concurrency:
        n = max(min_requests, c * rounds)
        r = asyncio.run(run_once(url, model, server, c, n, max_tokens, headers, reset, engine, verify, warm))
        print(format_row(r), flush=True)
        runs.append(r)
    return runs


def describe_load(
    url: str,
    model: str,
    concurrency: list[int],
    rounds: int,
    min_requests: int,
    max_tokens: int,
    reset: bool,
    verify: bool = False,
    warm: Warm | None = None,
) -> str:
    """What a sweep is about to do, for the lines above its rows."""
    levels = " ".join(map(str, concurrency))
    requests = " ".join(str(max(min_requests, c * rounds)) for c in concurrency)
    if not reset:
        cache = "prefix cache not reset (--no-reset): a run can hit what the runs before it cached"
    elif verify:
        cache = (
            "prefix cache reset before each run and verified cold by a canary prompt: every run starts cold"
        )
    else:
        cache = "prefix cache reset before each run (not verified, --no-verify): every run starts cold"
    if warm is not None:
        cache += (
            f", then warmed with {len(warm.prompts)} prompts{' (pinned)' if warm.pin else ''}, each proven "
            "warm: every run starts from that warm state"
        )
    return "\n".join(
        [
            f"server {url}, model {model}",
            f"load: concurrency {levels} (one run each, after a warm-up request), {requests} requests per run "
            f"({rounds} per client, at least {min_requests})",
            f"prompt: streamed chat completions, a {len(SYSTEM)}-character system prompt shared by all requests "
            f"and one of {len(QUESTIONS)} short questions; max tokens {max_tokens}, temperature 0",
            cache,
        ]
    )


# Every column of format_row and format_table, in order.
LEGEND = """columns (each run's line as it ends starts with the model's name):
  c, n, err      clients sending at once (concurrency), requests sent, requests that failed
  TTFT p50, p99  time to the first token, median and 99th percentile
  ITL p50, p99   inter-token latency (between streamed tokens), median and 99th percentile
  tok/s, req/s   output tokens and finished requests per second over the run
  hit            share of the prompt tokens served from the prefix cache (usage.cached_tokens / prompt_tokens;
                 - when the server does not report them); the shared system prompt makes it high once cached
  warm, pred     with --warm: the warm-up's proof (warm, cold, unknown) and the share of the run's prompt
                 tokens the warm set's full blocks cover, which the hit rate should reach (the run's own
                 repeats add to it); - without --warm, or when the server names no block size or tokens
  verified       the reset's canary: cold (nothing served from cache after the reset), warm (still served:
                 the reset failed, StillWarm), unknown (the server reports no cached tokens), - when not asked
  reset          the reset before the run: epoch N (kvpilot), ok, refused (HTTP status), failed (why), - when
                 off"""


def format_table(runs: list[RunResult]) -> str:
    """All runs of a sweep, one line each under a header (the final summary of `kvpilot bench`)."""
    lines = [
        f"{'c':>4} {'n':>4} {'err':>4} {'TTFT p50':>9} {'p99':>7} {'ITL p50':>8} {'p99':>6} "
        f"{'tok/s':>8} {'req/s':>6} {'hit':>5} {'warm':>7} {'pred':>5} {'verified':>8}  reset",
        f"{'':>4} {'':>4} {'':>4} {'ms':>9} {'ms':>7} {'ms':>8} {'ms':>6}",
    ]
    for r in runs:
        hit = "-" if r.cache_hit_rate_usage is None else f"{r.cache_hit_rate_usage:.2f}"
        pred = "-" if r.warm_predicted_hit_rate is None else f"{r.warm_predicted_hit_rate:.2f}"
        lines.append(
            f"{r.concurrency:>4d} {r.requests:>4d} {r.errors:>4d} {r.ttft_p50_ms:>9.0f} {r.ttft_p99_ms:>7.0f} "
            f"{r.itl_p50_ms:>8.0f} {r.itl_p99_ms:>6.0f} {r.output_tokens_per_s:>8.1f} {r.requests_per_s:>6.2f} "
            f"{hit:>5} {(r.warm or {}).get('verified') or '-':>7} {pred:>5} "
            f"{(r.reset or {}).get('verified') or '-':>8}  {_reset_word(r.reset)}"
        )
    return "\n".join(lines)


def _reset_word(reset: JSONObject | None) -> str:
    if reset is None:
        return "-"
    if reset["result"] == "Succeeded":
        return "ok" if reset["epoch"] is None else f"epoch {reset['epoch']}"
    if reset["reason"]:
        return f"failed ({reset['reason']})"
    if reset["http_status"] and reset["http_status"] != 200:
        return f"refused (HTTP {reset['http_status']})"
    return f"failed ({reset['result']})"


def format_row(r: RunResult) -> str:
    hit = "-" if r.cache_hit_rate_usage is None else f"{r.cache_hit_rate_usage:.2f}"
    return (
        f"{r.server:13s} c={r.concurrency:<3d} n={r.requests:<3d} err={r.errors} "
        f"TTFT p50 {r.ttft_p50_ms:8.0f} ms p99 {r.ttft_p99_ms:8.0f} ms  ITL p50 {r.itl_p50_ms:6.0f} ms "
        f"p99 {r.itl_p99_ms:6.0f} ms  {r.output_tokens_per_s:7.1f} tok/s  hit {hit}"
    )
