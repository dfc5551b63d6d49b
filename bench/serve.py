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
    .venv/bin/python bench/serve.py --vs-generate-batch    # bench/engine.py's load over HTTP, see below

`--vs-generate-batch`: bench/engine.py's shared-prefix load (16 chat requests sharing a ~295-token system
prompt) sent at once as chat completions that stop at EOS (`--max-tokens` caps them, 64 by default here),
against transformers `generate_batch` with block sharing on the same prompts, greedy, stopping at the
same EOS, in this process and with the daemon's thread count. Runs alternate between the two (`--rounds`
each); the daemon's prefix cache is reset before each of its runs. Output tokens/s = completion tokens
/ wall time; the two sides' completions are compared token for token. Results go to
`bench/results/serve-vs-generate-batch-<time>.json`.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

from kvpilot import benchkit
from kvpilot.devcluster.procs import free_port
from kvpilot.loadgen import RunResult, sweep

ROOT = Path(__file__).resolve().parent.parent

MODEL = "SmolLM2-135M-Instruct"


def _sizes(args: argparse.Namespace) -> dict:
    return {"rounds": args.rounds, "min_requests": args.min_requests, "max_tokens": args.max_tokens}


def bench_kvpilot(args: argparse.Namespace, logdir: Path) -> tuple[list[RunResult], str | None]:
    headers = {"Authorization": f"Bearer {args.admin_token}"} if args.admin_token else {}
    if args.url:
        model = args.model_name or MODEL
        return sweep(
            args.url.rstrip("/"), model, "kvpilot", args.concurrency, headers=headers, **_sizes(args)
        ), None
    flags = ["--max-num-seqs", str(max(args.concurrency)), *args.kvpilot_args]
    with benchkit.kvpilot_serve(logdir / "kvpilot.log", 600, *flags) as url:
        return sweep(url, MODEL, "kvpilot", args.concurrency, **_sizes(args)), None


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
    from kvpilot.daemon.engine.default_model import ensure_default_model

    model_dir = str(ensure_default_model())
    port = free_port()
    cmd = [
        exe,
        "serve",
        "--continuous-batching",
        "--device",
        "cpu",
        "--dtype",
        "float32",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        model_dir,
    ]
    try:
        proc = benchkit.launch(cmd, logdir / "transformers.log", f"http://127.0.0.1:{port}", 600, env=env)
    except RuntimeError as exc:
        return [], f"transformers serve did not start: {exc}"
    try:
        return sweep(
            f"http://127.0.0.1:{port}", model_dir, "transformers", args.concurrency, **_sizes(args)
        ), None
    finally:
        benchkit.shutdown(proc)


# ---- --vs-generate-batch ---------------------------------------------------------------------------
async def _chat_load(url: str, model: str, questions: list[str], system: str, max_tokens: int) -> dict:
    import aiohttp

    async def one(session: aiohttp.ClientSession, question: str) -> dict:
        body = {
            "model": model,
            "max_tokens": max_tokens,
            "temperature": 0,
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}],
        }
        async with session.post(url + "/v1/chat/completions", json=body) as resp:
            reply = await resp.json()
            if resp.status != 200:
                raise RuntimeError(f"HTTP {resp.status}: {reply}")
            return reply

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=1800)) as session:
        async with session.post(url + "/reset_prefix_cache") as resp:
            resp.raise_for_status()
        start = time.perf_counter()
        replies = await asyncio.gather(*(one(session, q) for q in questions))
        wall = time.perf_counter() - start
    tokens = [r["usage"]["completion_tokens"] for r in replies]
    return {
        "seconds": wall,
        "output_tokens": sum(tokens),
        "tokens_per_s": sum(tokens) / wall,
        "completion_tokens": tokens,
        "finish_reasons": [r["choices"][0]["finish_reason"] for r in replies],
        "cached_tokens": sum(
            (r["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0) for r in replies
        ),
        "texts": [r["choices"][0]["message"]["content"] for r in replies],
    }


def _generate_batch(model, tokenizer, prompts: list[list[int]], max_tokens: int) -> dict:  # noqa: ANN001
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    gen = GenerationConfig(
        max_new_tokens=max_tokens,
        do_sample=False,
        eos_token_id=model.generation_config.eos_token_id,
        pad_token_id=tokenizer.pad_token_id or 0,
    )
    cb = ContinuousBatchingConfig(
        allow_block_sharing=True, page_size=16, num_blocks=1024, max_batch_tokens=2048
    )
    start = time.perf_counter()
    out = model.generate_batch(prompts, generation_config=gen, continuous_batching_config=cb, warmup=False)
    wall = time.perf_counter() - start
    results = sorted(out.values(), key=lambda o: int(o.request_id.rsplit("_", 1)[-1]))
    eos = set(gen.eos_token_id if isinstance(gen.eos_token_id, list) else [gen.eos_token_id])
    # The EOS token ends a completion; it is not part of its text (nor of kvpilot's completion_tokens? it
    # is: OpenAI usage counts it), so both sides count it.
    tokens = [len(o.generated_tokens) for o in results]
    texts = [
        tokenizer.decode([t for t in o.generated_tokens if t not in eos], skip_special_tokens=True)
        for o in results
    ]
    return {
        "seconds": wall,
        "output_tokens": sum(tokens),
        "tokens_per_s": sum(tokens) / wall,
        "completion_tokens": tokens,
        "texts": texts,
    }


def vs_generate_batch(args: argparse.Namespace, logdir: Path) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from kvpilot.daemon.engine.default_model import ensure_default_model

    bench = benchkit.bench_module(Path(__file__).with_name("engine.py"))  # its load
    questions = [bench.QUESTIONS[i % len(bench.QUESTIONS)] for i in range(args.requests)]
    model_dir = ensure_default_model()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompts = [bench.chat(tokenizer, q) for q in questions]
    threads = args.cpu_threads or max(1, (os.cpu_count() or 2) - 1)
    flags = ["--max-num-seqs", str(args.requests), "--cpu-threads", str(threads), *args.kvpilot_args]
    runs: dict[str, list[dict]] = {"kvpilot_http": [], "transformers_generate_batch_sharing": []}
    with benchkit.kvpilot_serve(logdir / "kvpilot.log", 600, *flags) as url:
        torch.set_num_threads(threads)
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        asyncio.run(_chat_load(url, MODEL, questions[:1], bench.SYSTEM, 2))  # warm-up
        for _ in range(args.rounds):
            r = asyncio.run(_chat_load(url, MODEL, questions, bench.SYSTEM, args.max_tokens))
            runs["kvpilot_http"].append(r)
            print(
                f"kvpilot over HTTP      : {r['tokens_per_s']:.1f} tok/s ({r['output_tokens']} tokens in {r['seconds']:.1f} s)",
                flush=True,
            )
            r = _generate_batch(model, tokenizer, prompts, args.max_tokens)
            runs["transformers_generate_batch_sharing"].append(r)
            print(
                f"transformers generate_batch: {r['tokens_per_s']:.1f} tok/s ({r['output_tokens']} tokens in {r['seconds']:.1f} s)",
                flush=True,
            )
    med = {k: statistics.median(r["tokens_per_s"] for r in v) for k, v in runs.items()}
    ours, theirs = runs["kvpilot_http"][-1], runs["transformers_generate_batch_sharing"][-1]
    return {
        "load": {
            "requests": len(prompts),
            "prompt_tokens": [len(p) for p in prompts],
            "max_tokens": args.max_tokens,
            "stop": "EOS",
            "threads": threads,
        },
        "runs": runs,
        "median_tokens_per_s": med,
        "ratio_kvpilot_http_vs_generate_batch_sharing": med["kvpilot_http"]
        / med["transformers_generate_batch_sharing"],
        "same_completion_tokens": ours["completion_tokens"] == theirs["completion_tokens"],
        "same_texts": ours["texts"] == theirs["texts"],
    }


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
    p.add_argument(
        "--transformers-pythonpath",
        default=os.environ.get("KVPILOT_TRANSFORMERS_SERVE_PATH"),
        help="a directory holding fastapi+uvicorn for `transformers serve`",
    )
    p.add_argument(
        "--vs-generate-batch",
        action="store_true",
        help="bench/engine.py's load as chat requests stopping at EOS vs transformers generate_batch",
    )
    p.add_argument("--requests", type=int, default=16, help="requests of the --vs-generate-batch load")
    p.add_argument("--cpu-threads", type=int, help="torch threads of both sides (default: all cores but one)")
    p.add_argument("--output", type=Path, default=None)
    args = p.parse_args()
    if args.vs_generate_batch:
        return run_vs_generate_batch(args)

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
    out = args.output or benchkit.default_path(ROOT / "bench" / "results", "serve")
    benchkit.write(out, report, f" (server logs in {logdir})")
    return 0


def run_vs_generate_batch(args: argparse.Namespace) -> int:
    if "--max-tokens" not in sys.argv:
        args.max_tokens = 64
    if "--rounds" not in sys.argv:
        args.rounds = 2
    logdir = Path(tempfile.mkdtemp(prefix="kvpilot-bench-"))
    report = {
        "benchmark": "serve --vs-generate-batch",
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "host": {"cpus": os.cpu_count(), "platform": sys.platform},
        **vs_generate_batch(args, logdir),
    }
    print(
        f"ratio: {report['ratio_kvpilot_http_vs_generate_batch_sharing']:.2f}x; same completions: "
        f"{report['same_completion_tokens']} (tokens), {report['same_texts']} (text)"
    )
    out = args.output or benchkit.default_path(ROOT / "bench" / "results", "serve-vs-generate-batch")
    benchkit.write(out, report, f" (server log in {logdir})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
