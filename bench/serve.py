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
    .venv/bin/python bench/serve.py --vs-bound             # the same load against the torch decode bound
    .venv/bin/python bench/serve.py --vs-bound --compiled  # ... every side compiled (-O1)

`--vs-generate-batch`: bench/engine.py's shared-prefix load (16 chat requests sharing a ~295-token system
prompt) sent at once as chat completions that stop at EOS (`--max-tokens` caps them, 64 by default here),
against transformers `generate_batch` with block sharing on the same prompts, greedy, stopping at the
same EOS, in this process and with the daemon's thread count. Runs alternate between the two (`--rounds`
each); the daemon's prefix cache is reset before each of its runs. Output tokens/s = completion tokens
/ wall time; the two sides' completions are compared token for token. Results go to
`bench/results/serve-vs-generate-batch-<time>.json`.

`--vs-bound`: the same load against its bound, bench/torch_bound.py (the daemon's model weights in a
plain torch loop over a static KV cache, same prompts, same thread count, greedy to the same EOS), and,
to split the gap, against the daemon's engine run in this process without HTTP (`engine_in_process`),
its step timed by phase (scheduler, step inputs, attention plan, model, sampling). Runs alternate
between the three (`--rounds` each). The bound's tokens are checked against both (same token ids as the
engine, same texts and token counts as the daemon). `--profile` adds one more daemon run under py-spy
(shares of its samples per thread and function). Results go to `bench/results/serve-vs-bound-<time>.json`.
`--compiled`: the daemon and the engine in process at `-O1` and the bound under torch.compile the same way
(inductor, dynamic shapes); a first, untimed round of each side compiles every graph the timed rounds
run. Results go to `bench/results/serve-vs-bound-compiled-<time>.json`.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parents[1] / "hack" / "lib"))  # benchkit, devcluster

import benchkit
from devcluster.procs import free_port
from kvpilot.cli.loadgen import RunResult, sweep

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
    from kvpilot.default_model import ensure_default_model

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


def _bench(name: str):  # noqa: ANN202 - a module
    """bench/NAME.py, whose load or functions this bench reuses."""
    return benchkit.bench_module(Path(__file__).with_name(f"{name}.py"))


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
    texts = _texts(tokenizer, [o.generated_tokens for o in results], eos)
    return {
        "seconds": wall,
        "output_tokens": sum(tokens),
        "tokens_per_s": sum(tokens) / wall,
        "completion_tokens": tokens,
        "texts": texts,
    }


def _texts(tokenizer, completions: list[list[int]], eos: set[int] | frozenset[int]) -> list[str]:  # noqa: ANN001
    """Completions as the chat API returns their text: the EOS that ended them is not part of it."""
    return [tokenizer.decode([t for t in c if t not in eos], skip_special_tokens=True) for c in completions]


def _threads(args: argparse.Namespace) -> int:
    """torch threads of every side: as asked, else the daemon's default on this machine."""
    return args.cpu_threads or max(1, (os.cpu_count() or 2) - 1)


def vs_generate_batch(args: argparse.Namespace, logdir: Path) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from kvpilot.default_model import ensure_default_model

    bench = _bench("engine")  # its load
    questions = [bench.QUESTIONS[i % len(bench.QUESTIONS)] for i in range(args.requests)]
    model_dir = ensure_default_model()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompts = [bench.chat(tokenizer, q) for q in questions]
    threads = _threads(args)
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


# ---- --vs-bound ------------------------------------------------------------------------------------
# Where an engine step's time goes, as `_time_phases` splits it: (object attribute, phase).
PHASES = (
    ("scheduler.schedule", "scheduler"),
    ("scheduler.update", "scheduler"),
    ("runner.plan", "step plan"),  # token ids, positions, slots, block tables as lists
    ("runner._batch", "step tensors"),  # ... as tensors, and the attention metadata
    ("runner.run", "model"),  # the forward pass, with "step tensors" and "attention plan" inside it
    ("sampler.sample_step", "sampling"),
)


def _time_phases(engine) -> dict[str, float]:  # noqa: ANN001 - an LLMEngine of this process
    """Wrap the engine's step parts in timers; returns the seconds per phase, added up as steps run.
    The reference attention's plan (built by the first layer of each step) is its own phase;
    "step" is all of `step()`, so "step" minus the phases is the rest of it."""
    from kvpilot.kernels import reference_plan

    spent: dict[str, float] = {"step": 0.0, "attention plan": 0.0}

    def timed(fn, phase: str):  # noqa: ANN001, ANN202
        spent.setdefault(phase, 0.0)

        def run(*a, **kw):  # noqa: ANN002, ANN003, ANN202
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                spent[phase] += time.perf_counter() - t0

        return run

    for path, phase in PHASES:
        owner_path, _, attr = path.rpartition(".")
        owner = engine
        for part in filter(None, owner_path.split(".")):
            owner = getattr(owner, part)
        setattr(owner, attr, timed(getattr(owner, attr), phase))
    engine.step = timed(engine.step, "step")
    reference_plan._build = timed(reference_plan._build, "attention plan")
    return spent


def _engine_load(engine, spent: dict[str, float], prompts: list[list[int]], max_tokens: int) -> dict:  # noqa: ANN001
    """The load through the engine in this process (greedy, to EOS), from a cold prefix cache."""
    from kvpilot.daemon.engine.request import SamplingParams

    engine.reset_prefix_cache()
    before = dict(spent)
    start = time.perf_counter()
    out = engine.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0))
    wall = time.perf_counter() - start
    phases = {k: v - before[k] for k, v in spent.items()}
    phases["model"] -= phases["step tensors"] + phases["attention plan"]  # both run inside it
    phases["rest of step"] = phases["step"] - sum(v for k, v in phases.items() if k != "step")
    phases["outside step"] = wall - phases.pop("step")
    return {**_bench("torch_bound").completion_figures(out, wall), "phase_seconds": phases}


def _daemon_pid() -> int:
    """The `kvpilot serve` this process started (`benchkit.kvpilot_serve` keeps its handle)."""
    for task in Path("/proc/self/task").iterdir():
        for pid in (task / "children").read_text().split():
            if b"serve" in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0"):
                return int(pid)
    raise RuntimeError("no `kvpilot serve` child found")


def _thread_cpu(pid: int) -> dict[int, float]:
    """CPU seconds (user + system) each thread of process `pid` has used so far."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            fields = (task / "stat").read_text().rpartition(")")[2].split()
        except OSError:
            continue  # the thread ended
        out[int(task.name)] = (int(fields[11]) + int(fields[12])) / tick
    return out


def _measured(run, daemon: int | None) -> dict:  # noqa: ANN001 - a side's run, called with no arguments
    """Run one side, adding the CPU it took: `cpu_seconds` is this process's for a side run here, the
    daemon's (all its threads) for the one over HTTP, then with its engine thread's share apart and the
    load generator's (this process) beside it. On a shared machine, wall time says more about the other
    jobs; tokens per CPU second compare the work."""
    load = os.getloadavg()
    before, own = (_thread_cpu(daemon) if daemon else {}), time.process_time()
    r = run()
    own = time.process_time() - own
    r["load_average_before"] = load
    if daemon:
        spent = {t: c - before.get(t, 0.0) for t, c in _thread_cpu(daemon).items()}
        r["cpu_seconds"] = sum(spent.values())
        r["engine_thread_cpu_seconds"] = max(spent.values())  # the busiest thread: the engine's
        r["load_generator_cpu_seconds"] = own
    else:
        r["cpu_seconds"] = own
    r["tokens_per_cpu_s"] = r["output_tokens"] / r["cpu_seconds"]
    return r


def _profiled_load(url: str, questions: list[str], system: str, max_tokens: int, logdir: Path) -> dict:
    """One more run of the load with py-spy sampling the daemon (all threads, native frames off)."""
    py_spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    raw = logdir / "daemon-profile.txt"
    argv = [py_spy, "record", "--pid", str(_daemon_pid()), "--rate", "100", "--nonblocking", "--threads"]
    proc = subprocess.Popen([*argv, "--format", "raw", "--output", str(raw)], stdout=subprocess.DEVNULL)
    time.sleep(1.0)  # attached
    run = asyncio.run(_chat_load(url, MODEL, questions, system, max_tokens))
    proc.send_signal(signal.SIGINT)
    proc.wait(timeout=60)
    summary = _bench("fanout").profile_summary(raw)
    threads: dict[str, int] = {}
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if count.isdigit():
            name = stack.split(";", 1)[0]
            threads[name] = threads.get(name, 0) + int(count)
    total = max(sum(threads.values()), 1)
    return {
        "tokens_per_s": run["tokens_per_s"],
        "threads": {k: round(v / total, 3) for k, v in sorted(threads.items(), key=lambda kv: -kv[1])},
        **summary,
        "raw": str(raw),
    }


def vs_bound(args: argparse.Namespace, logdir: Path) -> dict:
    import torch

    from kvpilot.daemon.engine.config import EngineConfig
    from kvpilot.daemon.engine.engine import LLMEngine

    bench = _bench("engine")  # its load
    questions = [bench.QUESTIONS[i % len(bench.QUESTIONS)] for i in range(args.requests)]
    threads = _threads(args)
    level = "1" if args.compiled else None  # None: the device's default (eager on the CPU)
    flags = ["--max-num-seqs", str(args.requests), "--cpu-threads", str(threads), *args.kvpilot_args]
    if level:
        flags += ["-O", level]
    # The in-process engine's pool only needs to hold the load; the daemon's is its default size.
    engine = LLMEngine(
        EngineConfig(
            max_num_seqs=args.requests, cpu_threads=threads, num_kv_blocks=1024, compilation_config=level
        )
    )
    spent = _time_phases(engine)
    bound = _bench("torch_bound").TorchBound(engine.runner.model, engine.eos_token_ids, args.compiled)
    prompts = [bench.chat(engine.tokenizer, q) for q in questions]
    runs: dict[str, list[dict]] = {"kvpilot_http": [], "engine_in_process": [], "torch_bound": []}
    warmup: dict[str, float] = {}
    profile = None
    with benchkit.kvpilot_serve(logdir / "kvpilot.log", 600, *flags) as url:
        asyncio.run(_chat_load(url, MODEL, questions[:1], bench.SYSTEM, 2))  # warm-up
        daemon = _daemon_pid()
        sides = {
            "kvpilot_http": lambda: asyncio.run(
                _chat_load(url, MODEL, questions, bench.SYSTEM, args.max_tokens)
            ),
            "engine_in_process": lambda: _engine_load(engine, spent, prompts, args.max_tokens),
            "torch_bound": lambda: bound.generate(prompts, args.max_tokens),
        }
        if args.compiled:  # the load's own shapes (a batch of one row is one) compile here, untimed
            for name, run in sides.items():
                started = time.perf_counter()
                run()
                warmup[name] = time.perf_counter() - started
                print(f"{name:18}: compiled and ran once in {warmup[name]:.1f} s", flush=True)
        graphs = _graphs_compiled()
        for _ in range(args.rounds):
            for name, run in sides.items():
                r = _measured(run, daemon if name == "kvpilot_http" else None)
                runs[name].append(r)
                print(
                    f"{name:18}: {r['tokens_per_s']:.1f} tok/s ({r['output_tokens']} tokens in "
                    f"{r['seconds']:.1f} s), {r['tokens_per_cpu_s']:.1f} tokens per CPU second; "
                    f"load {r['load_average_before'][0]:.2f}",
                    flush=True,
                )
        graphs = _graphs_compiled() - graphs
        if args.profile:
            profile = _profiled_load(url, questions, bench.SYSTEM, args.max_tokens, logdir)
    med = {k: statistics.median(r["tokens_per_s"] for r in v) for k, v in runs.items()}
    per_cpu = {k: statistics.median(r["tokens_per_cpu_s"] for r in v) for k, v in runs.items()}
    http, ours, theirs = runs["kvpilot_http"][-1], runs["engine_in_process"][-1], runs["torch_bound"][-1]
    eos = engine.eos_token_ids
    phases = {
        k: statistics.median(r["phase_seconds"][k] for r in runs["engine_in_process"])
        for k in runs["engine_in_process"][0]["phase_seconds"]
    }
    return {
        "load": {
            "requests": len(prompts),
            "prompt_tokens": [len(p) for p in prompts],
            "shared_prefix_tokens": theirs["shared_prefix_tokens"],
            "max_tokens": args.max_tokens,
            "stop": "EOS",
            "threads": threads,
            "torch": torch.__version__,
            "compiled": args.compiled,
        },
        "warmup_seconds": warmup,
        # the engine in process's and the bound's; 0 unless a timed round met a shape the warm-up did not
        "graphs_compiled_in_timed_rounds": graphs,
        "runs": runs,
        "median_tokens_per_s": med,
        "ratio_kvpilot_http_vs_bound": med["kvpilot_http"] / med["torch_bound"],
        "ratio_engine_in_process_vs_bound": med["engine_in_process"] / med["torch_bound"],
        "median_tokens_per_cpu_s": per_cpu,
        "ratio_per_cpu_s_kvpilot_http_vs_bound": per_cpu["kvpilot_http"] / per_cpu["torch_bound"],
        "ratio_per_cpu_s_engine_in_process_vs_bound": per_cpu["engine_in_process"] / per_cpu["torch_bound"],
        "median_engine_phase_seconds": phases,
        "bound_same_token_ids_as_engine": ours["token_ids"] == theirs["token_ids"],
        "bound_same_completion_tokens_as_daemon": http["completion_tokens"] == theirs["completion_tokens"],
        "bound_same_texts_as_daemon": http["texts"] == _texts(engine.tokenizer, theirs["token_ids"], eos),
        "daemon_profile": profile,
    }


def _graphs_compiled() -> int:
    """Graphs torch.compile has compiled in this process so far."""
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


def run_vs_bound(args: argparse.Namespace) -> int:
    _load_defaults(args)
    logdir = Path(tempfile.mkdtemp(prefix="kvpilot-bench-"))
    report = {
        **benchkit.header("serve --vs-bound", os.getloadavg()),
        **vs_bound(args, logdir),
    }
    report["load_average_after"] = os.getloadavg()
    print(
        f"kvpilot over HTTP / bound: {report['ratio_kvpilot_http_vs_bound']:.2f} in tok/s, "
        f"{report['ratio_per_cpu_s_kvpilot_http_vs_bound']:.2f} in tokens per CPU second; engine in process / "
        f"bound: {report['ratio_engine_in_process_vs_bound']:.2f}, "
        f"{report['ratio_per_cpu_s_engine_in_process_vs_bound']:.2f}; bound's tokens the same: "
        f"{report['bound_same_token_ids_as_engine']} (engine's ids), "
        f"{report['bound_same_texts_as_daemon']} (daemon's texts)"
    )
    name = "serve-vs-bound-compiled" if args.compiled else "serve-vs-bound"
    out = args.output or benchkit.default_path(ROOT / "bench" / "results", name)
    benchkit.write(out, report, f" (server log in {logdir})")
    return 0


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
    p.add_argument(
        "--vs-bound",
        action="store_true",
        help="that load against the torch decode bound (bench/torch_bound.py) and the engine in process",
    )
    p.add_argument("--profile", action="store_true", help="--vs-bound: one more daemon run under py-spy")
    p.add_argument(
        "--compiled",
        action="store_true",
        help="--vs-bound: the daemon and the engine in process at -O1, the bound under torch.compile",
    )
    p.add_argument("--requests", type=int, default=16, help="requests of the --vs-generate-batch load")
    p.add_argument("--cpu-threads", type=int, help="torch threads of both sides (default: all cores but one)")
    p.add_argument("--output", type=Path, default=None)
    args = p.parse_args()
    if args.vs_generate_batch:
        return run_vs_generate_batch(args)
    if args.vs_bound:
        return run_vs_bound(args)

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


def _load_defaults(args: argparse.Namespace) -> None:
    """The shared-prefix load's sizes where the command line does not set them."""
    if "--max-tokens" not in sys.argv:
        args.max_tokens = 64
    if "--rounds" not in sys.argv:
        args.rounds = 2


def run_vs_generate_batch(args: argparse.Namespace) -> int:
    _load_defaults(args)
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
