"""Serving benchmark: a concurrency sweep of a shared-prefix chat load over HTTP.

Before each run the prefix cache is reset (`POST /reset_prefix_cache`), the use case of kvpilot: every
run starts cold, then its requests share a long system prompt. Per run: TTFT p50/p99, inter-token
latency p50/p99, output tokens/s, requests/s and the prefix-cache hit rate (from `usage.cached_tokens`
and from `/prefix_cache`). The same sweep runs against `transformers serve --continuous-batching`
where it starts (it needs fastapi+uvicorn: `pip install 'transformers[serving]'`, or point
`--transformers-pythonpath` at a `pip install --target DIR fastapi uvicorn`); otherwise the reason it was
skipped is recorded. Results go to `bench/results/serve-<time>.json`.

    .venv/bin/python bench/serve.py                        # CPU default: 1, 4, 16 clients, 16 tokens
    .venv/bin/python bench/serve.py --concurrency 1 8 32 64 --max-tokens 128 --rounds 4   # bigger
    .venv/bin/python bench/serve.py --url http://host:8000 # an already running daemon
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import aiohttp

ROOT = Path(__file__).resolve().parent.parent
SYSTEM = (
    "You are the support assistant of a bicycle shop. The shop sells road bikes, mountain bikes, "
    "city bikes and spare parts, repairs any bike within two days, and is open from nine to six on "
    "weekdays. Answer briefly and politely, and never invent prices. "
) * 3
QUESTIONS = [
    "Do you repair electric bikes?", "When are you open on Friday?", "Can I rent a bike?",
    "What brakes do road bikes use?", "Do you sell helmets?", "How long does a repair take?",
    "Can you fix a flat tire today?", "Which bike is best for a city commute?",
]  # fmt: skip


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
    reset: dict | str | None = None
    sample_errors: list[str] = field(default_factory=list)


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, max(0, round(q / 100 * (len(values) - 1))))]


async def one_request(
    session: aiohttp.ClientSession, url: str, model: str, i: int, max_tokens: int
) -> RequestResult:
    body = {
        "model": model,
        "messages": [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]},
        ],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start = time.perf_counter()
    ttft, last, itls, usage = None, None, [], {}
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


async def get_json(session: aiohttp.ClientSession, method: str, url: str) -> tuple[int, dict | str]:
    async with session.request(method, url) as resp:
        text = await resp.text()
        try:
            return resp.status, json.loads(text)
        except ValueError:
            return resp.status, text[:200]


async def run_once(
    url: str, model: str, server: str, concurrency: int, n: int, max_tokens: int, headers: dict
) -> RunResult:
    timeout = aiohttp.ClientTimeout(total=1800)
    async with aiohttp.ClientSession(timeout=timeout, headers=headers) as session:
        status, reply = await get_json(session, "POST", url + "/reset_prefix_cache")
        reset = reply if status == 200 else f"HTTP {status}: not supported by this server"
        before = await get_json(session, "GET", url + "/prefix_cache")
        queue: asyncio.Queue = asyncio.Queue()
        for i in range(n):
            queue.put_nowait(i)
        results: list[RequestResult] = []

        async def client() -> None:
            while not queue.empty():
                i = queue.get_nowait()
                try:
                    results.append(await one_request(session, url, model, i, max_tokens))
                except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
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
        usage_rate = sum(r.cached_tokens for r in ok) / max(1, sum(r.prompt_tokens for r in ok))
    engine_rate = None
    if before[0] == 200 and after[0] == 200:
        q = after[1]["query_tokens"] - before[1]["query_tokens"]
        engine_rate = (after[1]["hit_tokens"] - before[1]["hit_tokens"]) / q if q else None
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
        reset=reset,
        sample_errors=[r.error for r in results if r.error][:3],
    )


# ---- servers -------------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float) -> None:
    import urllib.request

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"not healthy after {timeout:.0f} s")


def start(cmd: list[str], env: dict, log: Path, port: int, timeout: float) -> subprocess.Popen:
    with open(log, "wb") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    try:
        wait_healthy(f"http://127.0.0.1:{port}", proc, timeout)
    except RuntimeError as exc:
        stop(proc)
        tail = log.read_text(errors="replace").strip().splitlines()[-3:]
        raise RuntimeError(f"{exc}: {' | '.join(tail)}") from None
    return proc


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def sweep(url: str, model: str, server: str, args: argparse.Namespace, headers: dict) -> list[RunResult]:
    # Warm-up (first-call costs: allocator, lazy init), then one cold run per concurrency.
    asyncio.run(run_once(url, model, server, 1, 1, 2, headers))
    runs = []
    for c in args.concurrency:
        n = max(args.min_requests, c * args.rounds)
        r = asyncio.run(run_once(url, model, server, c, n, args.max_tokens, headers))
        print(format_row(r), flush=True)
        runs.append(r)
    return runs


def format_row(r: RunResult) -> str:
    hit = "-" if r.cache_hit_rate_usage is None else f"{r.cache_hit_rate_usage:.2f}"
    return (
        f"{r.server:13s} c={r.concurrency:<3d} n={r.requests:<3d} err={r.errors} "
        f"TTFT p50 {r.ttft_p50_ms:8.0f} ms p99 {r.ttft_p99_ms:8.0f} ms  ITL p50 {r.itl_p50_ms:6.0f} ms "
        f"p99 {r.itl_p99_ms:6.0f} ms  {r.output_tokens_per_s:7.1f} tok/s  hit {hit}"
    )


def bench_kvpilot(args: argparse.Namespace, logdir: Path) -> tuple[list[RunResult], str | None]:
    headers = {"Authorization": f"Bearer {args.admin_token}"} if args.admin_token else {}
    if args.url:
        model = args.model_name or "SmolLM2-135M-Instruct"
        return sweep(args.url.rstrip("/"), model, "kvpilot", args, headers), None
    port = free_port()
    cmd = [sys.executable, "-m", "kvpilot", "serve", "--host", "127.0.0.1", "--port", str(port),
           "--max-num-seqs", str(max(args.concurrency)), *args.kvpilot_args]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "KVPILOT_ADMIN_TOKEN"}
    proc = start(cmd, env, logdir / "kvpilot.log", port, 600)
    try:
        return sweep(f"http://127.0.0.1:{port}", "SmolLM2-135M-Instruct", "kvpilot", args, {}), None
    finally:
        stop(proc)


def bench_transformers(args: argparse.Namespace, logdir: Path) -> tuple[list[RunResult], str | None]:
    exe = shutil.which("transformers") or str(Path(sys.executable).parent / "transformers")
    if not Path(exe).exists():
        return [], "the `transformers` CLI is not installed"
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    if args.transformers_pythonpath:
        env["PYTHONPATH"] = os.pathsep.join([args.transformers_pythonpath, env.get("PYTHONPATH", "")]).strip(
            os.pathsep
        )
    probe = subprocess.run([sys.executable, "-c", "import fastapi, uvicorn"], env=env, capture_output=True)
    if probe.returncode != 0:
        return (
            [],
            "transformers serve needs fastapi and uvicorn (pip install 'transformers[serving]'), not installed",
        )
    from kvpilot.daemon.default_model import ensure_default_model

    model_dir = str(ensure_default_model())
    port = free_port()
    cmd = [exe, "serve", "--continuous-batching", "--device", "cpu", "--dtype", "float32",
           "--host", "127.0.0.1", "--port", str(port), model_dir]  # fmt: skip
    try:
        proc = start(cmd, env, logdir / "transformers.log", port, 600)
    except RuntimeError as exc:
        return [], f"transformers serve did not start: {exc}"
    try:
        return sweep(f"http://127.0.0.1:{port}", model_dir, "transformers", args, {}), None
    finally:
        stop(proc)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--rounds", type=int, default=2, help="requests per client in each run (default 2)")
    p.add_argument("--min-requests", type=int, default=4, help="at least this many requests per run")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--url", help="benchmark this running kvpilot daemon instead of starting one")
    p.add_argument("--admin-token", default=os.environ.get("KVPILOT_ADMIN_TOKEN"), help="for --url")
    p.add_argument("--model-name", help="model name for --url")
    p.add_argument("--kvpilot-args", nargs=argparse.REMAINDER, default=[], help="extra `kvpilot serve` flags")
    p.add_argument("--skip-transformers", action="store_true")
    p.add_argument("--transformers-pythonpath", default=os.environ.get("KVPILOT_TRANSFORMERS_SERVE_PATH"),
                   help="a directory holding fastapi+uvicorn for `transformers serve`")  # fmt: skip
    p.add_argument("--output", type=Path, default=None)
    args = p.parse_args()

    logdir = Path(tempfile.mkdtemp(prefix="kvpilot-bench-"))
    report: dict = {
        "benchmark": "serve",
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "config": {k: v for k, v in vars(args).items() if k not in ("output", "admin_token")},
        "host": {"cpus": os.cpu_count(), "platform": sys.platform},
        "servers": {},
    }
    targets = [("kvpilot", bench_kvpilot)]
    if not args.skip_transformers and not args.url:
        targets.append(("transformers", bench_transformers))
    for name, fn in targets:
        runs, skipped = fn(args, logdir)
        report["servers"][name] = {"runs": [asdict(r) for r in runs], "skipped": skipped}
        if skipped:
            print(f"{name}: skipped: {skipped}", flush=True)
    out = (
        args.output
        or ROOT / "bench" / "results" / f"serve-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}.json"
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out} (server logs in {logdir})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
