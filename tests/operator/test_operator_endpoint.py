"""`kvpilot endpoint NAME` on the dev cluster (no DNS, no kube-proxy: status.endpoint does not resolve from the
host): the URL it prints answers GET /health from this process; a router pod's address with the router on, a
daemon pod's without; --in-cluster prints status.endpoint itself. Pods are stand-ins (the URL is the point)."""

from __future__ import annotations

import os
import subprocess
import sys
import urllib.request
from urllib.parse import urlsplit

import pytest

from support.cluster import Cluster
from support.operator import OperatorProcess, apply_ns, fleet, infd, standin_spec

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(300)]


def endpoint(cluster: Cluster, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "KUBECONFIG": str(cluster.kubeconfig)}
    return subprocess.run(
        [sys.executable, "-m", "kvpilot", "endpoint", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


def pod_ips(cluster: Cluster, ns: str, selector: str) -> dict[str, str]:
    pods = cluster.kubectl_json("get", "pods", "-n", ns, "-l", selector)["items"]
    return {p["status"].get("podIP"): p["metadata"]["name"] for p in pods}


def test_the_printed_url_answers_from_the_host(
    cluster: Cluster, namespace: str, operator: OperatorProcess
) -> None:
    ns = namespace
    apply_ns(cluster, ns, fleet("llm", {"replicas": 1, **standin_spec(), "router": {"enabled": True}}))
    apply_ns(cluster, ns, fleet("plain", {"replicas": 1, **standin_spec()}))
    for name in ("llm", "plain"):
        cluster.kubectl("wait", "--for=condition=Ready", f"infd/{name}", "-n", ns, "--timeout=180s")

    routed = endpoint(cluster, "llm", "-n", ns)
    assert routed.returncode == 0, routed.stderr
    url = routed.stdout.strip()
    routers = pod_ips(cluster, ns, "kvpilot.io/router=llm")
    assert urlsplit(url).hostname in routers and urlsplit(url).port == 8080, (url, routers)
    assert f"router pod {routers[urlsplit(url).hostname]}" in routed.stderr, routed.stderr
    assert f"in a pod use http://llm-router.{ns}.svc:8080" in routed.stderr, routed.stderr
    with urllib.request.urlopen(url + "/health", timeout=10) as r:
        assert r.status == 200

    plain = endpoint(cluster, "plain", "-n", ns)
    assert plain.returncode == 0, plain.stderr
    daemons = pod_ips(cluster, ns, "kvpilot.io/inference-deployment=plain")
    assert urlsplit(plain.stdout.strip()).hostname in daemons and "daemon pod" in plain.stderr, plain
    with urllib.request.urlopen(plain.stdout.strip() + "/health", timeout=10) as r:
        assert r.status == 200

    inside = endpoint(cluster, "llm", "-n", ns, "--in-cluster")
    assert inside.returncode == 0 and inside.stdout.strip() == infd(cluster, ns, "llm")["status"]["endpoint"]

    missing = endpoint(cluster, "nothere", "-n", ns)
    assert (
        missing.returncode == 2
        and missing.stderr.strip() == f"error: InferenceDeployment {ns}/nothere not found"
    )
