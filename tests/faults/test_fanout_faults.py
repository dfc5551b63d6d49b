"""A PrefixCacheReset's fan-out under faults of the dev cluster's real parts, with stand-in daemons (the
model is not the point): kube-apiserver killed and restarted mid fan-out, and a pod cut off from the network
(its veth link down) mid fan-out. Nothing is lost: the reset ends, within its timeout, with a status that
says what happened to each pod."""

from __future__ import annotations

import subprocess
import time

import pytest
from fault_figures import record

from support.cluster import Cluster
from support.operator import (
    OperatorProcess,
    apply_ns,
    fleet_pods,
    http,
    pcr,
    pods_by_name,
    reset_status,
    standin_fleet,
    wait_phase,
)
from support.procs import wait_for

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(600)]

SLOW = [{"name": "STANDIN_DELAY", "value": "2"}]  # each reset call takes 2 s: the fan-out lasts long enough


def pod_ips(cluster: Cluster, ns: str, fleet: str) -> dict[str, str]:
    return {p["metadata"]["name"]: p["status"]["podIP"] for p in fleet_pods(cluster, ns, fleet)}


def resets_seen(ips: dict[str, str]) -> dict[str, int]:
    """How many resets each stand-in applied (its own count, not the operator's word)."""
    return {name: http("GET", f"http://{ip}:8000/calls", timeout=10)["resets"] for name, ip in ips.items()}


def first_pod_done(cluster: Cluster, ns: str, name: str) -> dict | None:
    st = reset_status(cluster, ns, name)
    return st if st.get("phase") == "Running" and st.get("succeeded", 0) >= 1 else None


def test_apiserver_restart_mid_fanout(cluster: Cluster, ns: str, operator: OperatorProcess) -> None:
    """kube-apiserver dies after the first pod of four is reset and is down for 3 s: status writes and the pod
    watch fail meanwhile, yet the reset ends Succeeded with every pod flushed at least once, in the same run
    of the fan-out (a final status write refused while the restarted apiserver fills its RBAC cache is
    retried, not left to kopf, which would start the reset over a minute later)."""
    standin_fleet(cluster, ns, "steady", replicas=4, env=SLOW)
    ips = pod_ips(cluster, ns, "steady")
    t0 = time.monotonic()
    apply_ns(
        cluster,
        ns,
        pcr("through", {"targetRef": {"name": "steady"}, "maxConcurrency": 1, "timeoutSeconds": 120}),
    )
    wait_for(lambda: first_pod_done(cluster, ns, "through"), 60, "the first pod reset")
    outage = cluster.cp.restart_apiserver(down_s=3.0)
    t_back = time.monotonic()
    r = wait_phase(cluster, ns, "through", 120)
    t_end = time.monotonic()
    st = r["status"]
    assert st["phase"] == "Succeeded" and st["succeeded"] == 4 and st["failed"] == 0, st
    assert {p["result"] for p in st["pods"]} == {"Succeeded"} and set(pods_by_name(r)) == set(ips)
    cond = next(c for c in st["conditions"] if c["type"] == "Complete")
    assert cond["status"] == "True" and cond["reason"] == "AllPodsReset"
    resets = resets_seen(ips)
    assert all(n >= 1 for n in resets.values()), resets
    started_over = f"{ns}/through: interrupted" in operator.log.read_text()
    assert not started_over, "the reset was run again from the start (its first run failed)"
    record(
        "apiserver_restart_mid_fanout",
        pods=len(ips),
        apiserver_outage_s=round(outage, 1),
        reset_done_after_apiserver_back_s=round(t_end - t_back, 1),
        reset_total_s=round(t_end - t0, 1),
        flushes_per_pod=sorted(resets.values()),
    )


def set_link(cluster: Cluster, ns: str, pod: str, state: str) -> None:
    netns = cluster.netns_path(cluster.kubectl_json("get", "pod", pod, "-n", ns))
    subprocess.run(["nsenter", f"--net={netns}", "ip", "link", "set", "eth0", state], check=True, timeout=10)


def test_pod_cut_off_mid_fanout_fails_the_reset_in_time_naming_it(cluster: Cluster, ns: str) -> None:
    """One pod's veth link goes down while the fan-out runs: its calls time out or find no route, and the reset
    ends Failed within timeoutSeconds, naming that pod; the other pods are reset."""
    standin_fleet(cluster, ns, "cut", replicas=3, env=[{"name": "STANDIN_DELAY", "value": "4"}])
    ips = pod_ips(cluster, ns, "cut")
    # One call at a time, in the order the API server lists the pods (by name): the last one is called 8 s
    # in, a wide margin on a loaded machine to cut it off after the first pod's reset and before its own call.
    victim = sorted(ips)[-1]
    timeout_s = 30
    t0 = time.monotonic()
    apply_ns(
        cluster,
        ns,
        pcr(
            "cutoff",
            {
                "targetRef": {"name": "cut"},
                "maxConcurrency": 1,
                "timeoutSeconds": timeout_s,
                "requestTimeoutSeconds": 5,
                "retriesPerPod": 1,
            },
        ),
    )
    wait_for(lambda: first_pod_done(cluster, ns, "cutoff"), 40, "the first pod reset")
    set_link(cluster, ns, victim, "down")
    t_cut = time.monotonic()
    try:
        r = wait_phase(cluster, ns, "cutoff", timeout_s + 30)
        t_end = time.monotonic()
    finally:
        set_link(cluster, ns, victim, "up")
    st = r["status"]
    pods = pods_by_name(r)
    assert st["phase"] == "Failed" and pods[victim]["result"] == "Failed", st
    assert all(p["result"] == "Succeeded" for n, p in pods.items() if n != victim), pods
    cond = next(c for c in st["conditions"] if c["type"] == "Failed")
    assert cond["reason"] == "PodsFailed" and victim in cond["message"], cond
    assert t_end - t0 < timeout_s + 15, f"ended {t_end - t0:.1f}s after creation, timeoutSeconds {timeout_s}"
    others = resets_seen({n: ip for n, ip in ips.items() if n != victim})
    assert all(n == 1 for n in others.values()), others
    record(
        "pod_cut_off_mid_fanout",
        pods=len(ips),
        timeout_seconds=timeout_s,
        reset_ended_after_cut_s=round(t_end - t_cut, 1),
        reset_total_s=round(t_end - t0, 1),
        victim_attempts=pods[victim]["attempts"],
        victim_message=pods[victim]["message"],
        flushes_per_other_pod=sorted(others.values()),
    )
