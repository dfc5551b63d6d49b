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
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

from kvpilot.loadgen import RunResult, sweep

ROOT = Path(__file__).resolve().parent.parent


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


def _sizes(args: argparse.Namespace) -> dict:
    return {"rounds": args.rounds, "min_requests": args.min_requests, "max_tokens": args.max_tokens}


def bench_kvpilot(args: argparse.Namespace, logdir: Path) -> tuple[list[RunResult], str | None]:
    headers = {"Authorization": f"Bearer {args.admin_token}"} if args.admin_token else {}
    if args.url:
        model = args.model_name or "SmolLM2-135M-Instruct"
        return sweep(
            args.url.rstrip("/"), model, "kvpilot", args.concurrency, headers=headers, **_sizes(args)
        ), None
    port = free_port()
    cmd = [sys.executable, "-m", "kvpilot", "serve", "--host", "127.0.0.1", "--port", str(port),
           "--max-num-seqs", str(max(args.concurrency)), *args.kvpilot_args]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "KVPILOT_ADMIN_TOKEN"}
    proc = start(cmd, env, logdir / "kvpilot.log", port, 600)
    try:
        return sweep(
            f"http://127.0.0.1:{port}", "SmolLM2-135M-Instruct", "kvpilot", args.concurrency, **_sizes(args)
        ), None
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
    from kvpilot.daemon.engine.default_model import ensure_default_model

    model_dir = str(ensure_default_model())
    port = free_port()
    cmd = [exe, "serve", "--continuous-batching", "--device", "cpu", "--dtype", "float32",
           "--host", "127.0.0.1", "--port", str(port), model_dir]  # fmt: skip
    try:
        proc = start(cmd, env, logdir / "transformers.log", port, 600)
    except RuntimeError as exc:
        return [], f"transformers serve did not start: {exc}"
    try:
        return sweep(
            f"http://127.0.0.1:{port}", model_dir, "transformers", args.concurrency, **_sizes(args)
        ), None
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
