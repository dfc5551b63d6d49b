"""Fan-out of one PrefixCacheReset to N pods through the real API server, against a plain sequential loop.

    .venv/bin/python bench/fanout.py [--pods 1000] [--max-concurrency 64] [--reply-delay-ms 0 20] [--profile]

What runs: etcd + kube-apiserver + kube-controller-manager (devcluster.ControlPlane, hack/lib); N Pod objects
bound to a Node that no kubelet runs, whose status (Running, a running container, podIP 127.88.x.y) this
script writes itself; stand-in processes answering the daemon's reset reply on the N loopback addresses
(port 8000), one process per 1,000 addresses, address i served by process i % P so that the calls in flight
spread over all of them; the operator as a subprocess (`python -m kvpilot.operator.main --standalone`).
Measured per round: seconds from creating the PrefixCacheReset to phase Succeeded (polled every 20 ms),
status patches and API calls the operator made for it (its own counters), the CPU seconds of the operator
and of the stand-ins (from /proc; the busiest stand-in's share of the round says whether it, not the
operator, bounds the round), the load average, the size of the finished object and of its status, and the
same N reset calls as a sequential loop of urllib requests. `--profile` samples the operator with py-spy
during each round (a slower round: time the figures without it). Writes bench/results/fanout-N.json. Not a
test: it prints numbers (tests/operator/test_operator_scale.py runs it at 5,000 pods and checks the result).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parents[1] / "hack" / "lib"))  # benchkit, devcluster

import benchkit
from devcluster.procs import free_port, spawn, stop, wait_ready

ROOT = Path(__file__).resolve().parents[1]  # kvpilot itself is imported from the installed package

STANDIN = r"""
import asyncio, json, sys
from aiohttp import web
k, procs, n, port = (int(x) for x in sys.argv[1:5])
epochs = {}
delay = [0.0]
async def set_delay(request):
    delay[0] = float(request.query["s"]); return web.json_response({"delay": delay[0]})
async def reset(request):
    ip = request.transport.get_extra_info("sockname")[0]
    if delay[0]:
        await asyncio.sleep(delay[0])  # a daemon applies a reset between two engine steps
    epochs[ip] = epochs.get(ip, 0) + 1
    return web.json_response({"success": True, "epoch": epochs[ip], "evicted_blocks": 3, "in_flight_requests": 0,
                              "preempted_requests": 0, "duration_ms": 0.01, "ranks": [{"rank": 0, "success": True}]})
async def stats(request):
    return web.json_response({"epoch": epochs.get(request.transport.get_extra_info("sockname")[0], 0)})
async def total(request):
    return web.json_response({"resets": sum(epochs.values()), "addresses": len(epochs)})
async def main():
    app = web.Application()
    app.router.add_post("/reset_prefix_cache", reset); app.router.add_get("/prefix_cache", stats)
    app.router.add_get("/total", total); app.router.add_post("/delay", set_delay)
    runner = web.AppRunner(app, access_log=None); await runner.setup()
    for i in range(k, n, procs):
        await web.TCPSite(runner, f"127.88.{i // 250}.{i % 250 + 1}", port, backlog=1024).start()
    print("ready", flush=True)
    await asyncio.Event().wait()
asyncio.run(main())
"""
# Addresses per stand-in process: address i is served by process i % P, so the calls in flight (in pod name
# order) spread over all of them, and no one process answering bounds a round (checked in each round:
# busiest_standin_cpu_share, its CPU seconds over the round's wall time).
PER_STANDIN = 1000


def ip_of(i: int) -> str:
    return f"127.88.{i // 250}.{i % 250 + 1}"


def load() -> str:
    """The 1, 5 and 15 minute load averages, as `uptime` prints them."""
    return ", ".join(f"{x:.2f}" for x in os.getloadavg())


def profile_summary(raw: Path, top: int = 30) -> dict:
    """py-spy's raw (folded) stacks as shares of the samples: per function, where it is on the stack
    (inclusive) and where it is the innermost frame (self)."""
    incl: dict[str, int] = {}
    own: dict[str, int] = {}
    total = 0
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        total += n
        # "func (path/to/file.py:LINE)" -> "func (file.py)": one entry per function, not per line
        frames = [
            f.split(" (", 1)[0] + " (" + f.rsplit("/", 1)[-1].split(":", 1)[0] + ")" for f in stack.split(";")
        ]
        for f in set(frames):
            incl[f] = incl.get(f, 0) + n
        own[frames[-1]] = own.get(frames[-1], 0) + n

    def shares(d: dict[str, int]) -> dict[str, float]:
        best = sorted(d.items(), key=lambda kv: -kv[1])[:top]
        return {k: round(v / max(total, 1), 3) for k, v in best}

    return {"samples": total, "inclusive": shares(incl), "self": shares(own)}


def metric(port: int, name: str) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        text = r.read().decode()
    return sum(
        float(x.rsplit(" ", 1)[1])
        for x in text.splitlines()
        if x.startswith(name + "{") or x.startswith(name + " ")
    )


def make_pods(core, ns: str, n: int) -> None:  # noqa: ANN001
    from kubernetes import client

    now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())

    def one(i: int) -> None:
        name = f"bench-{i:04d}"
        pod = client.V1Pod(
            metadata=client.V1ObjectMeta(name=name, labels={"app": "bench"}),
            spec=client.V1PodSpec(
                node_name="bench-node", containers=[client.V1Container(name="d", image="x")]
            ),
        )
        core.create_namespaced_pod(ns, pod)
        core.patch_namespaced_pod_status(
            name,
            ns,
            {
                "status": {
                    "phase": "Running",
                    "podIP": ip_of(i),
                    "podIPs": [{"ip": ip_of(i)}],
                    "hostIP": "127.0.0.1",
                    "containerStatuses": [
                        {
                            "name": "d",
                            "ready": True,
                            "restartCount": 0,
                            "image": "x",
                            "imageID": "",
                            "state": {"running": {"startedAt": now}},
                        }
                    ],
                    "conditions": [{"type": "Ready", "status": "True", "lastTransitionTime": now}],
                }
            },
        )

    with concurrent.futures.ThreadPoolExecutor(16) as ex:
        list(ex.map(one, range(n)))


def sequential(n: int, port: int) -> float:
    t0 = time.perf_counter()
    for i in range(n):
        req = urllib.request.Request(f"http://{ip_of(i)}:{port}/reset_prefix_cache", data=b"", method="POST")
        with urllib.request.urlopen(req, timeout=10) as r:
            assert json.loads(r.read())["success"] is True
    return time.perf_counter() - t0


def one_round(
    custom, ns: str, port: int, mport: int, args: argparse.Namespace, delay_ms: float, pids: dict
) -> dict:  # noqa: ANN001
    name = f"all-{int(delay_ms)}ms"
    patches0 = metric(mport, "kvpilot_operator_reset_status_patches_total")
    calls0 = metric(mport, "kvpilot_operator_api_calls_total")
    body = {
        "apiVersion": "kvpilot.io/v1alpha1",
        "kind": "PrefixCacheReset",
        "metadata": {"name": name},
        "spec": {
            "selector": {"matchLabels": {"app": "bench"}},
            "maxConcurrency": args.max_concurrency,
            "port": port,
            "timeoutSeconds": 300,
            "requestTimeoutSeconds": 60,
            # the stand-in pods serve no completions: a canary would only add two refused calls a pod
            # (bench/reset_verify.py measures verification against a real daemon)
            "verify": False,
        },
    }
    spy = raw = None
    if args.profile:  # sampled from outside: all the operator's threads, nothing instrumented inside it
        raw = Path(args.out).with_name(f"fanout-{args.pods}-{int(delay_ms)}ms-profile.txt")
        argv = [args.py_spy, "record", "--pid", str(pids["operator"][0]), "--rate", "200", "--nonblocking"]
        spy = subprocess.Popen([*argv, "--format", "raw", "--output", str(raw)], stdout=subprocess.DEVNULL)
        time.sleep(1.0)  # attached
    load_before = load()
    cpu0 = {p: benchkit.cpu_s(p) for v in pids.values() for p in v}
    t0 = time.perf_counter()
    custom.create_namespaced_custom_object("kvpilot.io", "v1alpha1", ns, "prefixcacheresets", body)
    while True:
        obj = custom.get_namespaced_custom_object("kvpilot.io", "v1alpha1", ns, "prefixcacheresets", name)
        if (obj.get("status") or {}).get("phase") in ("Succeeded", "Failed"):
            break
        time.sleep(0.02)
    fanout_s = time.perf_counter() - t0
    used = {p: benchkit.cpu_s(p) - c for p, c in cpu0.items()}
    st = obj["status"]
    object_bytes, status_bytes = len(json.dumps(obj)), len(json.dumps(st))
    time.sleep(0.5)  # the final metric updates
    patches = metric(mport, "kvpilot_operator_reset_status_patches_total") - patches0
    calls = metric(mport, "kvpilot_operator_api_calls_total") - calls0
    out = {
        "reply_delay_ms": delay_ms,
        "phase": st["phase"],
        "succeeded": st["succeeded"],
        "targets": st["targets"],
        "create_to_complete_s": round(fanout_s, 3),
        "operator_status_patches": int(patches),
        "status_patches_per_s": round(patches / fanout_s, 2),
        "operator_api_calls": int(calls),
        "status_bytes": status_bytes,
        "object_bytes": object_bytes,
        "status_pod_entries": len(st.get("pods") or []),
        "cpu_s": {k: round(sum(used[p] for p in v), 3) for k, v in pids.items()},
        "operator_cpu_ms_per_pod": round(1000 * used[pids["operator"][0]] / max(args.pods, 1), 3),
        # near 1.0 the busiest stand-in process, not the operator, would bound the round
        "busiest_standin_cpu_share": round(max(used[p] for p in pids["standin"]) / fanout_s, 2),
        "load_before": load_before,
    }
    if spy is not None and raw is not None:
        spy.send_signal(signal.SIGINT)
        spy.wait(60)
        out["profile"] = {"raw": raw.name, **profile_summary(raw)}
    if args.sequential and delay_ms <= args.sequential_max_delay_ms:
        seq_load = load()
        seq_s = sequential(args.pods, port)
        out |= {
            "sequential_loop_s": round(seq_s, 3),
            "fanout_over_sequential": round(fanout_s / seq_s, 3),
            "sequential_over_fanout": round(seq_s / fanout_s, 2),
            "load_before_sequential": seq_load,
        }
    out["load_after"] = load()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pods", type=int, default=1000)
    ap.add_argument("--max-concurrency", type=int, default=64)
    ap.add_argument(
        "--reply-delay-ms",
        type=float,
        nargs="+",
        default=[0.0, 20.0],
        help="stand-in reply delay per round (default 0 and 20 ms)",
    )
    ap.add_argument(
        "--sequential",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also time the same calls as a sequential loop (default on)",
    )
    ap.add_argument(
        "--sequential-max-delay-ms",
        type=float,
        default=float("inf"),
        help="run the sequential loop only in rounds with at most this reply delay (10,000 pods at 20 ms: 200 s)",
    )
    ap.add_argument(
        "--profile",
        action="store_true",
        help="sample the operator with py-spy during each round (its raw stacks beside the JSON, a summary in it); "
        "a profiled round runs slower: time the figures without it",
    )
    ap.add_argument("--out", default=None, help="JSON result (default bench/results/fanout-PODS.json)")
    args = ap.parse_args()
    args.py_spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    if args.profile and not Path(args.py_spy).exists():
        ap.error("--profile needs py-spy (pip install py-spy)")
    args.out = args.out or str(ROOT / "bench" / "results" / f"fanout-{args.pods}.json")

    from kubernetes import client, config

    from devcluster import ControlPlane

    work = Path(tempfile.mkdtemp(prefix="kvpilot-bench-fanout-"))
    procs: list[subprocess.Popen] = []
    rounds: list[dict] = []
    port = free_port()
    with ControlPlane(workdir=work / "cp") as cp:
        api = config.new_client_from_config(config_file=str(cp.kubeconfig))
        core = client.CoreV1Api(api)
        subprocess.run(
            ["kubectl", f"--kubeconfig={cp.kubeconfig}", "apply", "-f", str(ROOT / "crds")],
            check=True,
            capture_output=True,
        )
        wait = ["kubectl", f"--kubeconfig={cp.kubeconfig}", "wait", "--for=condition=Established"]
        for _ in range(10):  # on a loaded machine the CRD may not be served yet at the first try
            done = subprocess.run(
                [*wait, "crd/prefixcacheresets.kvpilot.io", "--timeout=60s"], capture_output=True, text=True
            )
            if done.returncode == 0:
                break
            time.sleep(2.0)
        else:
            raise SystemExit(f"the PrefixCacheReset CRD is not established: {done.stderr}")
        core.create_node(client.V1Node(metadata=client.V1ObjectMeta(name="bench-node")))
        ns = "bench"
        core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=ns)))
        try:
            nproc = -(-args.pods // PER_STANDIN)
            standins = [
                subprocess.Popen(
                    [sys.executable, "-c", STANDIN, str(k), str(nproc), str(args.pods), str(port)],
                    stdout=subprocess.PIPE,
                    start_new_session=True,
                )
                for k in range(nproc)
            ]
            procs += standins
            for standin in standins:
                assert standin.stdout is not None and standin.stdout.readline().strip() == b"ready"
            t0 = time.perf_counter()
            make_pods(core, ns, args.pods)
            setup_s = time.perf_counter() - t0
            mport, lport = free_port(), free_port()
            argv = [sys.executable, "-m", "kvpilot.operator.main", "--standalone", "--bind", "127.0.0.1"]
            argv += ["--metrics-port", str(mport), "--liveness-port", str(lport), "--log-level", "INFO"]
            op_log = work / "operator.log"
            op = spawn(argv, log_path=op_log, env={**os.environ, "KUBECONFIG": str(cp.kubeconfig)})
            procs.append(op)
            healthz = f"http://127.0.0.1:{lport}/healthz"
            wait_ready(
                op,
                lambda: urllib.request.urlopen(healthz, timeout=1).status == 200,
                60,
                "the operator",
                op_log,
            )
            time.sleep(1.0)  # the watch streams are open
            custom = client.CustomObjectsApi(api)
            pids = {"operator": [op.pid], "standin": [p.pid for p in standins]}
            for delay_ms in args.reply_delay_ms:
                for k in range(nproc):  # one call per stand-in process
                    urllib.request.urlopen(
                        urllib.request.Request(
                            f"http://{ip_of(k)}:{port}/delay?s={delay_ms / 1000}", data=b"", method="POST"
                        )
                    )
                rounds.append(one_round(custom, ns, port, mport, args, delay_ms, pids))
                print(json.dumps(rounds[-1]), flush=True)
        finally:
            for p in procs:
                stop(p, grace=10)
    result = {
        "pods": args.pods,
        "max_concurrency": args.max_concurrency,
        "rounds": rounds,
        "setup_pods_s": round(setup_s, 1),
        "note": "create_to_complete: from creating the PrefixCacheReset to reading phase Succeeded; it includes "
        "kopf noticing it, one pod list, the pod watch, N reset calls in a sliding window and the status patches "
        "(one at the start, one per second of progress, one final). status_bytes: the finished status (counts "
        "and at most 100 pod entries). The sequential loop is N POSTs only. reply_delay_ms models a daemon "
        "answering a reset at the next engine step boundary.",
        "standin_processes": nproc,
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "load_average_1m": os.getloadavg()[0],
            "load_at_end": load(),
        },
    }
    print(json.dumps(result, indent=2))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    return 0 if all(r["phase"] == "Succeeded" for r in rounds) else 1


if __name__ == "__main__":
    raise SystemExit(main())
