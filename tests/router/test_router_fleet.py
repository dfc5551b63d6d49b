"""`kvpilot router --fleet NAME`: the pods come from the Service's EndpointSlices in a real API server."""

from __future__ import annotations

import ipaddress
import json

import openai
import pytest

from support.cluster import Cluster
from support.procs import wait_for
from support.servers import MODEL, start_daemon, start_router, stop_fleet

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(600)]


def endpoint_slice(name: str, ns: str, ip: str, port: int, ready: bool = True) -> dict:
    return {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {"name": name, "namespace": ns, "labels": {"kubernetes.io/service-name": "llm"}},
        "addressType": "IPv4",
        "ports": [{"name": "http", "port": port, "protocol": "TCP"}],
        "endpoints": [
            {
                "addresses": [ip],
                "conditions": {"ready": ready},
                "targetRef": {"kind": "Pod", "name": name, "namespace": ns},
            }
        ],
    }


def test_router_follows_the_fleets_endpointslices(cluster: Cluster, namespace: str, tmp_path) -> None:  # noqa: ANN001, F811
    # The daemons run on this host; the API server refuses loopback endpoints, so they are named by the
    # host's address on the dev cluster's bridge (first address of the pod network).
    host_ip = str(next(ipaddress.ip_network(cluster.pod_cidr, strict=False).hosts()))
    daemons = [start_daemon(tmp_path, host="0.0.0.0") for _ in range(2)]
    router = None
    try:
        cluster.kubectl("create", "service", "clusterip", "llm", "--tcp=8000:8000", "-n", namespace)
        for name, d in zip(("llm-a", "llm-b"), daemons):
            cluster.kubectl(
                "apply", "-f", "-", input=json.dumps(endpoint_slice(name, namespace, host_ip, d.port))
            )
        router = start_router(
            tmp_path, None, "--fleet", "llm", "-n", namespace, env={"KUBECONFIG": str(cluster.kubeconfig)}
        )
        assert sorted(p["pod"] for p in router.health()["pods"]) == ["llm-a", "llm-b"]
        c = openai.OpenAI(base_url=router.url + "/v1", api_key="x", max_retries=0)
        raw = c.completions.with_raw_response.create(model=MODEL, prompt="Hello", max_tokens=2, temperature=0)
        assert raw.headers["x-kvpilot-pod"] in ("llm-a", "llm-b")
        r = router.request("POST", "/reset_prefix_cache", headers=router.admin())
        assert r.status == 200, r.body
        assert sorted(p["pod"] for p in r.json()["pods"]) == ["llm-a", "llm-b"]
        # An endpoint that turns unready leaves the fleet; the router follows the watch.
        cluster.kubectl(
            "apply",
            "-f",
            "-",
            input=json.dumps(endpoint_slice("llm-b", namespace, host_ip, daemons[1].port, ready=False)),
        )
        wait_for(lambda: [p["pod"] for p in router.health()["pods"]] == ["llm-a"], 30, "llm-b to leave")
        r = router.request("POST", "/reset_prefix_cache", headers=router.admin())
        assert r.status == 200 and [p["pod"] for p in r.json()["pods"]] == ["llm-a"], r.body
        # A fleet with no pod left: nothing is flushed, so the answer is not a success (503, which AIPerf
        # retries while a fleet scales up).
        cluster.kubectl("delete", "endpointslice", "llm-a", "-n", namespace)
        wait_for(lambda: router.health()["pods"] == [], 30, "the last pod to leave")
        r = router.request("POST", "/reset_prefix_cache", headers=router.admin())
        assert r.status == 503 and r.json()["error"]["code"] == "no_pods", r.body
    finally:
        stop_fleet(router, daemons)
