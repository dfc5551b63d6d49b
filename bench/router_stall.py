"""Router stall: does `kvpilot router` keep answering GET /health on time while clients send huge bodies?

One `kvpilot serve` (the default model, KV events on) behind `kvpilot router --policy prefix-aware`, both
started as bench/router.py starts them. A probe process asks the router's /health every 100 ms (a new
connection each time, as a kubelet probe does) for `--seconds`, in three phases:

  A  nothing else: the baseline;
  B  `--clients` clients (asyncio, in one more process) each POSTing again and again a /v1/completions body
     of 2,000,000 token ids (3.8 MiB: over the router's parse limit, under its 4 MiB body limit); the
     router routes it by load unread and the daemon refuses it (400, the prompt is past the context);
  C  the same with 200,000 token ids of 4 digits (0.95 MiB), just under the parse limit (1 MiB for the
     default model's 8192-token context): the router parses and keys each body in its prompt threads,
     which is what B's bodies cost it before the limit, and the daemon refuses it.

Per phase: /health latency p50, p99 and max; the requests the load completed over the probe's window and
their statuses; the router's routing decisions by reason (C's body, sent again and again, is keyed and so
routed by prefix; B's, unread, never); CPU seconds of the router and the daemon. Then the ratios of B and
C to A. The bench exits 1 (after writing its JSON) when a phase's premise fails: a reply other than 400,
a failed probe, B keyed or C not.

    .venv/bin/python bench/router_stall.py                 # 3 phases of 10 s, 24 clients: ~2 minutes
    .venv/bin/python bench/router_stall.py --seconds 5     # a quick look

Results go to bench/results/router-stall-<UTC time>.json (--out to choose).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from pathlib import Path

import aiohttp

import kvpilot

sys.path.append(str(Path(__file__).resolve().parents[1] / "hack" / "lib"))  # benchkit, devcluster

import benchkit
from devcluster.procs import free_port
from kvpilot.cli.loadgen import pct

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "bench"
bench_router = benchkit.bench_module(BENCH / "router.py")  # start_daemon, start_router, its metrics

# (phase, token ids per body, digits per id): None for the baseline. 2 bytes an id ("5,") make B's
# body 3.8 MiB, 5 bytes ("1234,") C's 0.95 MiB.
PHASES = (("A", None), ("B", (2_000_000, 1)), ("C", (200_000, 4)))


# ---- the probe and the load, each run as this file in its own process ---------------------------------
def probe(url: str, seconds: float, interval: float) -> dict:
    """GET /health every `interval` seconds for `seconds`; a probe that comes back late is followed at once,
    not by a burst of the ones it held up. The window is in wall-clock time, which the load process shares."""
    latencies, failures = [], []
    window = [time.time()]
    end = time.perf_counter() + seconds
    due = time.perf_counter()
    while due < end:
        time.sleep(max(0.0, due - time.perf_counter()))
        start = time.perf_counter()
        try:
            with urllib.request.urlopen(url + "/health", timeout=30) as r:
                r.read()
        except OSError as exc:  # an HTTP error status too: a probe that fails counts as failed
            failures.append(repr(exc)[:200])
        latencies.append(time.perf_counter() - start)
        due = max(due + interval, time.perf_counter())
    window.append(time.time())
    return {"window": window, "latencies_s": latencies, "failures": failures}


def completion_body(ids: int, digits: int) -> bytes:
    """A /v1/completions body of `ids` token ids of `digits` digits each, without spaces."""
    low = 10 ** (digits - 1)
    prompt = [low + i % (9 * low) for i in range(ids)]
    doc = {"model": bench_router.MODEL, "prompt": prompt, "max_tokens": 1}
    return json.dumps(doc, separators=(",", ":")).encode()


async def load(url: str, body: bytes, clients: int) -> dict:
    """`clients` clients POSTing `body` back to back. Says "ready" on stdout once they are sending, then
    reads the probe's window ("START END", wall-clock seconds) from stdin; stops sending, lets the requests
    in flight finish, and returns what completed in the window."""
    loop = asyncio.get_running_loop()
    done: list[tuple[float, object, float]] = []  # (wall-clock end, status or error, seconds)
    window: list[float] = []
    stop = asyncio.Event()
    headers = {"Content-Type": "application/json"}

    async def client(session: aiohttp.ClientSession) -> None:
        while not stop.is_set():
            start = time.perf_counter()
            try:
                async with session.post(url + "/v1/completions", data=body, headers=headers) as r:
                    await r.read()
                    status: object = r.status
            except (aiohttp.ClientError, TimeoutError) as exc:
                status = type(exc).__name__
            done.append((time.time(), status, time.perf_counter() - start))

    async def control() -> None:
        print("ready", flush=True)
        window.extend(map(float, (await loop.run_in_executor(None, sys.stdin.readline)).split()))
        stop.set()

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
        await asyncio.gather(control(), *(client(session) for _ in range(clients)))
    drained = time.time() - window[1]
    mine = [d for d in done if window[0] <= d[0] <= window[1]]
    return {
        "body_bytes": len(body),
        "clients": clients,
        "completed": len(mine),
        "per_s": round(len(mine) / (window[1] - window[0]), 2),
        "statuses": dict(Counter(str(d[1]) for d in mine)),
        "statuses_with_drain": dict(Counter(str(d[1]) for d in done)),
        "request_p50_s": round(pct([d[2] for d in mine], 50), 3),
        "request_max_s": round(max((d[2] for d in mine), default=float("nan")), 3),
        "drain_s": round(drained, 1),  # the requests in flight at the window's end, finishing after it
    }


# ---- the phases -------------------------------------------------------------------------------------
def decisions(url: str) -> dict[str, float]:
    """The router's routing decisions so far, by reason."""
    metrics = bench_router.router_metrics(url)
    reasons = ("prefix", "load", "round-robin")
    return {r: bench_router.total(metrics, "routing_decisions_total", f'reason="{r}"') for r in reasons}


def run_probe(url: str, args: argparse.Namespace) -> dict:
    argv = [sys.executable, __file__, "--probe", url, "--seconds", str(args.seconds)]
    argv += ["--interval", str(args.interval)]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=args.seconds + 120, check=True)
    return json.loads(out.stdout)


def phase(
    name: str, body: tuple[int, int] | None, url: str, pids: dict[str, int], args: argparse.Namespace
) -> dict:
    """One phase: the probe's window, under the load of `body` (token ids, digits) or none."""
    loader = None
    if body is not None:
        argv = [sys.executable, __file__, "--load", url, "--ids", str(body[0]), "--digits", str(body[1])]
        loader = subprocess.Popen(
            argv + ["--clients", str(args.clients)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        if loader.stdout.readline().strip() != "ready":
            raise RuntimeError(f"phase {name}: the load process did not start (exit {loader.wait()})")
        time.sleep(args.ramp)  # every client has a request in flight, some have finished one
    cpu0 = {k: benchkit.cpu_s(pid) for k, pid in pids.items()}
    before, t0 = decisions(url), time.perf_counter()
    window = "0 0\n"  # what stops the load if the probe fails
    try:
        probed = run_probe(url, args)
        window = "{:f} {:f}\n".format(*probed["window"])
    finally:
        if loader is not None:
            loader.stdin.write(window)
            loader.stdin.close()
    after, took = decisions(url), time.perf_counter() - t0
    # Over the probe process's whole run (its start included), as a share of one core.
    cpu = {f"{k}_cores": round((benchkit.cpu_s(pid) - cpu0[k]) / took, 2) for k, pid in pids.items()}
    lat = probed["latencies_s"]
    row: dict = {"phase": name, "probes": len(lat), "probe_failures": probed["failures"][:5]}
    row["probe_failed"] = len(probed["failures"])
    row |= {f"health_{q}_ms": round(pct(lat, n) * 1e3, 1) for q, n in (("p50", 50), ("p99", 99))}
    row["health_max_ms"] = round(max(lat) * 1e3, 1)
    row |= cpu
    row["decisions"] = {k: after[k] - before[k] for k in after}
    if loader is not None:
        out = loader.stdout.read()  # bounded: each request has 120 s at most
        if loader.wait():
            raise RuntimeError(f"phase {name}: the load process failed (exit {loader.returncode})")
        row["load"] = {"token_ids": body[0]} | json.loads(out)
    return row


def premise_failures(rows: dict[str, dict]) -> list[str]:
    """What makes a phase not measure what it says it measures."""
    bad = [f"{n}: {r['probe_failed']} /health probes failed" for n, r in rows.items() if r["probe_failed"]]
    for n, r in rows.items():
        if "load" in r and set(r["load"]["statuses_with_drain"]) != {"400"}:
            bad.append(f"{n}: replies other than 400 (or none): {r['load']['statuses_with_drain']}")
    if rows["B"]["decisions"]["prefix"]:
        bad.append("B: bodies over the parse limit were keyed (routed by prefix)")
    if not rows["C"]["decisions"]["prefix"]:
        bad.append("C: bodies under the parse limit were never keyed (no prefix decision)")
    return bad


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--probe", metavar="URL", help=argparse.SUPPRESS)
    ap.add_argument("--load", metavar="URL", help=argparse.SUPPRESS)
    ap.add_argument("--ids", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--digits", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--seconds", type=float, default=10.0, help="each phase's probe window (default 10)")
    ap.add_argument("--interval", type=float, default=0.1, help="seconds between probes (default 0.1)")
    ap.add_argument("--clients", type=int, default=24, help="clients sending bodies in B and C (default 24)")
    ap.add_argument("--ramp", type=float, default=2.0, help="seconds of load before the window (default 2)")
    ap.add_argument("--label", default="", help="a note kept in the JSON (e.g. before/after)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    if args.probe:
        print(json.dumps(probe(args.probe, args.seconds, args.interval)))
        return 0
    if args.load:
        print(json.dumps(asyncio.run(load(args.load, completion_body(args.ids, args.digits), args.clients))))
        return 0

    load_before = os.getloadavg()
    tmp = Path(tempfile.mkdtemp(prefix="router-stall-"))
    token_file = tmp / "token"
    token_file.write_text(bench_router.TOKEN)
    procs = []
    try:
        # 256 KV blocks: every request is refused before it needs any.
        daemon_proc, daemon = bench_router.start_daemon(
            256, token_file, tmp / "daemon.log", free_port(), free_port()
        )
        procs.append(daemon_proc)
        router_proc, url = bench_router.start_router("prefix-aware", [daemon], token_file, tmp / "router.log")
        procs.append(router_proc)
        pids = {"router": router_proc.pid, "daemon": daemon_proc.pid}
        rows = {}
        for name, body in PHASES:
            rows[name] = phase(name, body, url, pids, args)
            print(f"phase {name}: {json.dumps(rows[name])}", flush=True)
    finally:
        for proc in reversed(procs):
            benchkit.shutdown(proc)

    ratios = {}
    for name in ("B", "C"):
        ratios[f"{name}/A"] = {
            q: round(rows[name][f"health_{q}_ms"] / rows["A"][f"health_{q}_ms"], 1)
            for q in ("p50", "p99", "max")
        }
    print(f"\n{'phase':<30} {'p50 ms':>8} {'p99 ms':>8} {'max ms':>8} {'done':>6} {'router cores':>12}")
    for name, row in rows.items():
        what = (
            "no load"
            if "load" not in row
            else f"{row['load']['token_ids']:,} ids, {row['load']['body_bytes'] / (1 << 20):.2f} MiB"
        )
        done = row["load"]["completed"] if "load" in row else "-"
        print(
            f"{name + ' ' + what:<30} {row['health_p50_ms']:>8} {row['health_p99_ms']:>8} {row['health_max_ms']:>8} "
            f"{done:>6} {row['router_cores']:>12}"
        )
    for name, r in ratios.items():
        print(f"{name}: p50 {r['p50']}x, p99 {r['p99']}x, max {r['max']}x")
    bad = premise_failures(rows)
    doc = benchkit.header("router_stall", load_before)
    doc |= {
        "label": args.label,
        "git": benchkit.git_head(),
        "args": {k: v for k, v in vars(args).items() if k not in ("out", "probe", "load", "ids", "digits")},
    }
    doc["kvpilot"] = str(Path(kvpilot.__file__).parent)  # the checkout whose router and daemon ran
    doc |= {"ratios": ratios, "premise_failures": bad, "phases": rows}
    benchkit.write(args.out or benchkit.default_path(BENCH / "results", "router-stall"), doc)
    for line in bad:
        print(f"premise failed: {line}", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
