"""The first request a scaled-up pod serves, with and without a warm-up's readiness gate; one JSON file under
bench/results/.

    .venv/bin/python bench/warmup_gate.py [--rounds 2]

What runs: the dev cluster (hack/cluster/devcluster.py: etcd, kube-apiserver, kube-controller-manager,
kube-scheduler and a node of the real kubelet, which runs each pod of the project's image, a real `kvpilot serve`
on the embedded model), the operator
(`kvpilot operator --standalone`), an InferenceDeployment of 2 daemons and a Continuous PrefixCacheWarmup of
one long system prompt (docs/warmup.md). For each mode, `gateReadiness: false` then `true`, and each round:
the fleet is scaled from 2 to 3; the script watches the fleet Service's EndpointSlices (what kube-proxy and
the fleet router route by) and, the moment the new pod is a ready endpoint, sends it the chat a client of the
fleet would (the system prompt and a question, streamed) and times its first token; the reply's usage says how
many prompt tokens came from cache. Then the fleet goes back to 2 pods. The baseline, in the same run: the same
chat to a pod that has been warm all along.

Without the gate the pod is routed to as soon as its model is loaded, before the warm-up's next look (every
3 s) has warmed it: its first client pays the whole prefill. With the gate it is routed to only once
verified warm.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parents[1] / "hack" / "lib"))  # benchkit, devcluster

import benchkit
from devcluster.procs import free_port, spawn, stop

ROOT = Path(__file__).resolve().parents[1]
HERE = Path(__file__).resolve().parent
NS = "default"
FLEET = "llm"
SYSTEM = (
    "You are the support assistant of an inference platform team. You answer questions about running language "
    "model servers on Kubernetes: prefix caches, KV blocks, readiness gates, rollouts, autoscaling, and the "
    "operator that resets and warms a fleet. Answer in one short sentence, cite the manual section you used, "
    "and never invent a section number. "
) * 6  # 463 tokens as a chat: a cold prefill of it is what the first client of a cold pod waits for
QUESTION = "How do I scale the fleet without cold starts?"


class Kube:
    """kubectl on the bench's own dev cluster."""

    def __init__(self, kubeconfig: Path) -> None:
        self.argv = [shutil.which("kubectl") or "/usr/bin/kubectl", f"--kubeconfig={kubeconfig}"]

    def __call__(self, *args: str, input: str | None = None) -> str:
        r = subprocess.run([*self.argv, *args], input=input, capture_output=True, text=True, timeout=300)
        if r.returncode != 0:
            raise RuntimeError(f"kubectl {' '.join(args)}: {r.stderr.strip()}")
        return r.stdout

    def json(self, *args: str) -> dict:
        return json.loads(self(*args, "-o", "json"))

    def apply(self, obj: dict) -> None:
        self("apply", "-n", NS, "-f", "-", input=json.dumps(obj))


def poll(check, timeout: float, what: str, interval: float):  # noqa: ANN001, ANN201 - any truthy value
    """`check()` every `interval` seconds until it is truthy (returned); RuntimeError after `timeout`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if value := check():
            return value
        time.sleep(interval)
    raise RuntimeError(f"no {what} within {timeout:.0f} s")


def fleet_pods(kube: Kube) -> dict[str, dict]:
    pods = kube.json("get", "pods", "-n", NS, "-l", f"kvpilot.io/inference-deployment={FLEET}")
    return {p["metadata"]["name"]: p for p in pods["items"] if not p["metadata"].get("deletionTimestamp")}


def ready_endpoints(kube: Kube) -> set[str]:
    """The pods the fleet's Service routes to: its EndpointSlices' endpoints whose `ready` condition holds."""
    slices = kube.json("get", "endpointslices", "-n", NS, "-l", f"kubernetes.io/service-name={FLEET}")
    return {
        ep["targetRef"]["name"]
        for s in slices["items"]
        for ep in s.get("endpoints") or []
        if (ep.get("conditions") or {}).get("ready")
    }


def first_request(ip: str) -> dict:
    """The client's chat, streamed: seconds to its first token and its prompt tokens served from cache."""
    body = {
        "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}],
        "max_tokens": 4,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    conn = http.client.HTTPConnection(ip, 8000, timeout=120)
    t0 = time.perf_counter()
    conn.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    if resp.status != 200:
        raise RuntimeError(f"{ip}: {resp.status} {resp.read()[:300]!r}")
    ttft, usage = None, {}
    for line in resp:
        if not line.startswith(b"data: {"):
            continue
        chunk = json.loads(line[6:])
        if ttft is None and any((c.get("delta") or {}).get("content") for c in chunk.get("choices") or []):
            ttft = time.perf_counter() - t0
        usage = chunk.get("usage") or usage
    conn.close()
    if ttft is None:
        raise RuntimeError(f"{ip}: the stream ended without a token")
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return {
        "ttft_s": round(ttft, 3),
        "prompt_tokens": usage.get("prompt_tokens"),
        "cached_tokens": cached,
    }


def settle(kube: Kube, replicas: int) -> dict[str, dict]:
    """Wait until the fleet has `replicas` pods, each a ready endpoint and verified warm by the warm-up."""

    def settled() -> dict[str, dict] | None:
        pods = fleet_pods(kube)
        if len(pods) != replicas or set(pods) != ready_endpoints(kube):
            return None
        st = kube.json("get", "pcw", "keep", "-n", NS).get("status") or {}
        warm = {e["name"] for e in st.get("pods") or [] if e.get("verified") == "warm"}
        return pods if set(pods) <= warm else None

    return poll(settled, 600, f"{replicas} ready and warm pods", interval=1)


def scale_up_once(kube: Kube, before: dict[str, dict]) -> dict:
    """Scale to 3 and send the new pod its first request the moment the Service routes to it."""
    kube("patch", "infd", FLEET, "-n", NS, "--type=merge", "-p", '{"spec":{"replicas":3}}')
    t0 = time.monotonic()
    deadline = t0 + 600
    while time.monotonic() < deadline:
        pods = fleet_pods(kube)
        new = [n for n in pods if n not in before]
        if new and new[0] in ready_endpoints(kube) and pods[new[0]]["status"].get("podIP"):
            got = first_request(pods[new[0]]["status"]["podIP"])
            got["routed_after_s"] = round(time.monotonic() - t0, 1)
            got["pod"] = new[0]
            return got
        time.sleep(0.05)
    raise RuntimeError("the new pod never became a ready endpoint")


def run_mode(kube: Kube, gate: bool, rounds: int) -> dict:
    spec = {
        "targetRef": {"name": FLEET},
        "prompts": [{"messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hi"}]}],
        "mode": "Continuous",
        "gateReadiness": gate,
    }
    kube.apply(
        {
            "apiVersion": "kvpilot.io/v1alpha1",
            "kind": "PrefixCacheWarmup",
            "metadata": {"name": "keep"},
            "spec": spec,
        }
    )
    firsts, baselines = [], []
    for i in range(rounds):
        two = settle(kube, 2)
        baselines.append(first_request(next(iter(two.values()))["status"]["podIP"]))
        got = scale_up_once(kube, two)
        print(f"gateReadiness={str(gate).lower()} round {i + 1}: first request {got}", flush=True)
        firsts.append(got)
        settle(kube, 3)
        kube("patch", "infd", FLEET, "-n", NS, "--type=merge", "-p", '{"spec":{"replicas":2}}')
    kube("delete", "pcw", "keep", "-n", NS, "--timeout=60s")
    return {"gate_readiness": gate, "first_requests": firsts, "warm_pod_baseline": baselines}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=2, help="scale-ups per mode")
    p.add_argument("--out", type=Path, help="JSON path (default bench/results/warmup-gate-<time>.json)")
    args = p.parse_args()
    load_before = os.getloadavg()
    work = Path(tempfile.mkdtemp(prefix="kvpilot-warmup-gate-"))
    cluster = work / "cluster"
    devcluster = [sys.executable, str(ROOT / "hack" / "cluster" / "devcluster.py")]
    operator = None
    try:
        subprocess.run([*devcluster, "up", "--dir", str(cluster)], check=True)
        kube = Kube(cluster / "kubeconfig")
        kube("apply", "-f", str(ROOT / "crds"))
        kube("wait", "--for=condition=Established", "crd", "--all")
        liveness = free_port()
        env = os.environ | {"KUBECONFIG": str(cluster / "kubeconfig")}
        operator = spawn(
            [
                sys.executable,
                "-m",
                "kvpilot",
                "operator",
                "--standalone",
                "--bind",
                "127.0.0.1",
                "--liveness-port",
                str(liveness),
                "--metrics-port",
                str(free_port()),
            ],
            log_path=work / "operator.log",
            env=env,
        )
        kube.apply(
            {
                "apiVersion": "kvpilot.io/v1alpha1",
                "kind": "InferenceDeployment",
                "metadata": {"name": FLEET},
                "spec": {"replicas": 2, "engine": {"maxNumSeqs": 4, "kvCacheBlocks": 512}},
            }
        )
        modes = [run_mode(kube, gate, args.rounds) for gate in (False, True)]
    finally:
        if operator is not None:
            stop(operator, grace=30)
        subprocess.run([*devcluster, "down", "--dir", str(cluster)], check=False)

    def mean_ttft(rows: list[dict]) -> float:
        return round(sum(r["ttft_s"] for r in rows) / len(rows), 3)

    off, on = modes
    doc = benchkit.header("warmup_gate", load_before) | {
        "commit": benchkit.git_head(),
        "rounds": args.rounds,
        "system_prompt_chars": len(SYSTEM),
        "modes": modes,
        "first_request_ttft_s": {
            "without_gate": mean_ttft(off["first_requests"]),
            "with_gate": mean_ttft(on["first_requests"]),
        },
        "warm_pod_ttft_s": mean_ttft(off["warm_pod_baseline"] + on["warm_pod_baseline"]),
        # what the gate costs: seconds from the scale-up to the pod's first routed request
        "routed_after_s": {
            "without_gate": round(sum(r["routed_after_s"] for r in off["first_requests"]) / args.rounds, 1),
            "with_gate": round(sum(r["routed_after_s"] for r in on["first_requests"]) / args.rounds, 1),
        },
    }
    doc["ratio_without_over_with_gate"] = round(
        doc["first_request_ttft_s"]["without_gate"] / max(doc["first_request_ttft_s"]["with_gate"], 1e-6), 2
    )
    benchkit.write(args.out or benchkit.default_path(HERE / "results", "warmup-gate"), doc)
    print(
        json.dumps(
            {k: doc[k] for k in ("first_request_ttft_s", "warm_pod_ttft_s", "ratio_without_over_with_gate")}
        )
    )


if __name__ == "__main__":
    main()
