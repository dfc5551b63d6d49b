"""What the benchmarks in bench/ share: servers (`kvpilot serve` among them) started in their own process
group and waited for, the machine and its load beside the numbers (they depend on what
else runs there), and one JSON file per run. bench/ scripts run as files (`python bench/x.py`) and so cannot
import each other; what they share lives here, on devcluster.procs: dev tooling in hack/lib (which each script
appends to sys.path), outside the kvpilot package and its image."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import subprocess
import sys
import time
import urllib.request
from collections.abc import Awaitable, Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import aiohttp

from devcluster.procs import free_port, spawn, stop, wait_ready


def bench_module(path: Path):  # noqa: ANN201 - a module
    """The bench script at `path` (bench/NAME.py) loaded as a module, for a bench that reuses another one's
    load or functions: bench/ is not a package (its scripts run as files)."""
    spec = importlib.util.spec_from_file_location(f"bench_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def health(url: str) -> dict:
    """GET URL/health: its JSON body ({} when it is not JSON); raises OSError unless it answers 2xx."""
    with urllib.request.urlopen(url + "/health", timeout=5) as r:
        raw = r.read()
    try:
        body = json.loads(raw)
    except ValueError:
        return {}
    return body if isinstance(body, dict) else {}


def samples(text: str) -> dict[str, float]:
    """Prometheus text as `name{labels}` -> value (comments skipped)."""
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            out[key] = float(value)
    return out


def metrics(url: str) -> dict[str, float]:
    """A daemon's or router's GET URL/metrics, as `samples`."""
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        return samples(r.read().decode())


def launch(
    argv: Sequence[str],
    log: Path,
    url: str,
    timeout: float,
    env: dict | None = None,
    ready: Callable[[dict], bool] = lambda body: True,
) -> subprocess.Popen:
    """Start `argv` in its own process group (output to `log`; by default without the caller's
    $KVPILOT_ADMIN_TOKEN) and return once URL/health answers and `ready(its body)` holds."""
    if env is None:
        env = {k: v for k, v in os.environ.items() if k != "KVPILOT_ADMIN_TOKEN"}
    proc = spawn(argv, log_path=log, env=env)
    wait_ready(proc, lambda: ready(health(url)), timeout, Path(argv[0]).name + " " + " ".join(argv[1:4]), log)
    return proc


def tools_bin(name: str) -> str:
    """The path of a tool `make tools` builds (sglang-router, vllm-router, ...) in the tools cache."""
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run(
        ["make", "-s", "-C", str(root), "tools-bindir"], capture_output=True, text=True, check=True
    )
    return str(Path(out.stdout.strip()) / name)


def cpu_s(pid: int) -> float:
    """CPU seconds (user + system, all threads, exited ones too) of the process `pid` and of every live
    process below it: a router whose Python launcher runs its work in a child is measured whole. Reaped
    children are not counted, so take both readings while the tree runs.

    Read from each process's CPU-time clock (clock_getcpuclockid(3)), exact to the nanosecond: /proc's
    utime and stime come in 10 ms ticks, as coarse as a whole run's difference between two routers."""
    parents: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:  # the process ended meanwhile
            continue
        parents[int(stat.parent.name)] = int(text[text.rindex(")") + 2 :].split()[1])  # proc(5) field 4: ppid
    tree, total = [pid], 0.0
    while tree:
        p = tree.pop()
        try:
            total += time.clock_gettime(_process_cpu_clock(p))
        except OSError:  # it ended meanwhile
            pass
        tree += [c for c, parent in parents.items() if parent == p]
    return total


def tree_pids(pid: int) -> list[int]:
    """`pid` and every live process below it (from /proc's parent links), parents before children."""
    parents: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:
            continue
        parents[int(stat.parent.name)] = int(text[text.rindex(")") + 2 :].split()[1])
    tree, out = [pid], []
    while tree:
        p = tree.pop()
        out.append(p)
        tree += [c for c, parent in parents.items() if parent == p]
    return out


def _process_cpu_clock(pid: int) -> int:
    """The clock id clock_getcpuclockid(3) gives for `pid` (the kernel's encoding: ~pid << 3 | CPUCLOCK_SCHED),
    which Python's time module does not expose."""
    return (~pid << 3) | 2


def git_head() -> str:
    """The checkout's commit (short), kept beside a run's figures."""
    root = Path(__file__).resolve().parents[2]
    r = subprocess.run(
        ["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    )
    return r.stdout.strip()


def shutdown(proc: subprocess.Popen) -> None:
    """SIGTERM the server as Kubernetes would; what is left of its group is killed after 60 s."""
    stop(proc, grace=60, leader_only=True)


@contextmanager
def kvpilot_serve(log: Path, timeout: float, *flags: str) -> Iterator[str]:
    """`kvpilot serve FLAGS` (this Python's) on a free loopback port, started as `launch` does: yields its
    URL once it answers /health, and shuts it down when the block ends."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    argv = [sys.executable, "-m", "kvpilot", "serve", "--host", "127.0.0.1", "--port", str(port), *flags]
    proc = launch(argv, log, url, timeout)
    try:
        yield url
    finally:
        shutdown(proc)


def header(bench: str, load_before: tuple[float, float, float]) -> dict:
    """The first keys of a run's JSON: which bench, when (UTC), on how many CPUs, under what load before
    and after the run."""
    return {
        "bench": bench,
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "cpus": len(os.sched_getaffinity(0)),
        "load_average_before": load_before,
        "load_average_after": os.getloadavg(),
    }


def best_times(passes: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """Each pass's best wall time (s) of `repeats`, the passes taking turns, so that all see the same load."""
    best = dict.fromkeys(passes, float("inf"))
    for _ in range(repeats):
        for name, run in passes.items():
            start = time.perf_counter()
            run()
            best[name] = min(best[name], time.perf_counter() - start)
    return best


def default_path(results: Path, name: str) -> Path:
    """`results/NAME-YYYYmmdd-HHMMSS.json` (UTC): one file per run, never overwritten by the next."""
    return results / f"{name}-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}.json"


def write(path: Path, doc: dict, note: str = "") -> Path:
    """Write `doc` as indented JSON to `path` (its folder made if missing) and say so."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=2) + "\n")
    print(f"wrote {path}{note}")
    return path


def changed_checkpoint(original: Path, out: Path, seed: int = 22) -> Path:
    """Write to `out` the checkpoint `original` with every MLP down projection perturbed (seeded): the same
    names and shapes, other greedy outputs; a weight update's second version (bench/weights.py, tests)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(original, dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("mlp.down_proj.weight"):
                p.add_(torch.randn(p.shape, generator=gen) * p.std() * 0.3)
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(original).save_pretrained(out)
    return out


async def stream_chat(
    session: aiohttp.ClientSession,
    url: str,
    model: str,
    system: str,
    user: str,
    max_tokens: int,
    headers: dict[str, str] | None = None,
    ignore_eos: bool = False,
) -> dict:
    """One streamed chat completion as its client sees it: the pod that answered (kvpilot's router names it
    in X-Kvpilot-Pod, Envoy in x-upstream-host), the time to its first content token (`ttft`; the whole
    reply when none came) and to its end (`e2e`), its prompt, cached and completion tokens. `{"error":
    ...}` for a reply other than 200. `ignore_eos`: exactly `max_tokens` tokens (vLLM's and kvpilot's field)."""
    body = {
        "model": model,
        "max_tokens": max_tokens,
        "temperature": 0,
        **({"ignore_eos": True} if ignore_eos else {}),
        "stream": True,
        "stream_options": {"include_usage": True},
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}],
    }
    start = time.perf_counter()
    ttft, usage = None, {}
    async with session.post(url + "/v1/chat/completions", json=body, headers=headers or {}) as resp:
        if resp.status != 200:
            return {"error": f"HTTP {resp.status}: {(await resp.text())[:200]}"}
        pod = resp.headers.get("X-Kvpilot-Pod") or resp.headers.get("x-upstream-host")
        async for raw in resp.content:
            line = raw.strip()
            if not line.startswith(b"data: {"):
                continue
            event = json.loads(line[6:])
            if event.get("usage"):
                usage = event["usage"]
            if ttft is None and any(
                (c.get("delta") or {}).get("content") for c in event.get("choices") or []
            ):
                ttft = time.perf_counter() - start
    e2e = time.perf_counter() - start
    return {
        "pod": pod,
        "ttft": ttft if ttft is not None else e2e,
        "e2e": e2e,
        "prompt_tokens": usage.get("prompt_tokens", 0),
        "completion_tokens": usage.get("completion_tokens", 0),
        "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0,
    }


async def run_load(
    items: Sequence, concurrency: int, ask: Callable[[aiohttp.ClientSession, object], Awaitable[dict]]
) -> list[dict]:
    """`ask(session, item)` for every item, `concurrency` clients at a time sharing one session; the
    results in the order they finished."""
    queue: asyncio.Queue = asyncio.Queue()
    for item in items:
        queue.put_nowait(item)
    results: list[dict] = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=1800)) as session:

        async def client() -> None:
            while not queue.empty():
                results.append(await ask(session, queue.get_nowait()))

        await asyncio.gather(*(client() for _ in range(concurrency)))
    return results
