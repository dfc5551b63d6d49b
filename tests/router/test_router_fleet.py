"""`kvpilot router --fleet NAME` through a real API server: the pods come from the fleet Service's
EndpointSlices, and only those that are the fleet's pods count. The operator makes the fleet (stand-in daemons)
and the router's ServiceAccount and Role (router replicas 0); the router runs here, under that ServiceAccount's
token, so its Role is exactly what it has."""

from __future__ import annotations

import base64
import json

import pytest
from kubernetes import config

from kvpilot.kube.endpointslices import Endpoint
from kvpilot.operator.fleets.builders import serving_selector
from kvpilot.router.fleet.discovery import FleetMembers
from support.cluster import Cluster
from support.operator import (
    OperatorProcess,
    apply_ns,
    fleet,
    fleet_pods,
    http,
    ready_replicas,
    service_account_kubeconfig,
    standin_pod,
    standin_spec,
)
from support.procs import wait_for
from support.servers import MODEL, start_router, stop_router

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(600)]


def forged_slice(ns: str, endpoints: list[tuple[str, str]]) -> dict:
    """An EndpointSlice written by hand for Service llm: each endpoint (address, the Pod its targetRef names)
    ready on port 8000."""
    return {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {"name": "llm-forged", "namespace": ns, "labels": {"kubernetes.io/service-name": "llm"}},
        "addressType": "IPv4",
        "ports": [{"name": "http", "port": 8000, "protocol": "TCP"}],
        "endpoints": [
            {
                "addresses": [ip],
                "conditions": {"ready": True},
                "targetRef": {"kind": "Pod", "name": pod, "namespace": ns},
            }
            for ip, pod in endpoints
        ],
    }


def test_router_follows_only_the_fleets_own_pods(
    cluster: Cluster, namespace: str, operator: OperatorProcess, tmp_path
) -> None:  # noqa: ANN001
    ns, router = namespace, None
    apply_ns(
        cluster,
        ns,
        fleet("llm", {"replicas": 2, **standin_spec(), "router": {"enabled": True, "replicas": 0}}),
    )
    wait_for(lambda: ready_replicas(cluster, ns, "llm", 2), 90, "2 ready stand-in daemons")
    daemons = {p["metadata"]["name"]: p["status"]["podIP"] for p in fleet_pods(cluster, ns, "llm")}
    # Listening pods that must get neither prompts nor the token: one wearing the fleet's labels but run by
    # something else (the endpointslice controller lists it: the Service selects it), one that a hand-made
    # slice names.
    cluster.kubectl("create", "configmap", "owner", "-n", ns)
    cm_uid = cluster.kubectl_json("get", "configmap", "owner", "-n", ns)["metadata"]["uid"]
    owner = {"apiVersion": "v1", "kind": "ConfigMap", "name": "owner", "uid": cm_uid, "controller": True}
    apply_ns(cluster, ns, standin_pod("rogue", serving_selector("llm"), owner=owner))
    apply_ns(cluster, ns, standin_pod("listener", {"role": "listener"}))
    for pod in ("rogue", "listener"):
        cluster.kubectl("wait", "--for=condition=Ready", f"pod/{pod}", "-n", ns, "--timeout=60s")
    ip = {
        p: cluster.kubectl_json("get", "pod", p, "-n", ns)["status"]["podIP"] for p in ("rogue", "listener")
    }
    a_daemon = sorted(daemons)[0]
    cluster.kubectl("apply", "-f", "-", input=json.dumps(forged_slice(ns, [(ip["listener"], "listener")])))

    secret = cluster.kubectl_json("get", "secret", "llm-admin-token", "-n", ns)
    token = base64.b64decode(secret["data"]["token"]).decode()
    kubeconfig = service_account_kubeconfig(cluster, ns, "llm-router", tmp_path / "router-kubeconfig")
    try:
        router = start_router(
            tmp_path,
            None,
            "--fleet",
            "llm",
            "-n",
            ns,
            token=token,
            all_pods=False,
            env={"KUBECONFIG": str(kubeconfig)},
        )

        def pods() -> list[str]:
            return sorted(p["pod"] for p in router.health()["pods"])

        wait_for(lambda: pods() == sorted(daemons), 60, "the router to follow the fleet's two pods")
        # The rogue pod, listed by the endpointslice controller, was seen and turned down.
        wait_for(lambda: "endpoint rogue" in router.log(), 60, "the rogue pod refused")
        assert pods() == sorted(daemons)
        body = {"model": MODEL, "prompt": "Hello", "max_tokens": 2}
        for _ in range(6):
            r = router.request("POST", "/v1/completions", body)
            assert r.headers.get("X-Kvpilot-Pod") in daemons, (r.status, r.headers)
        r = router.request("POST", "/reset_prefix_cache", headers=router.admin())
        assert r.status == 200 and sorted(p["pod"] for p in r.json()["pods"]) == sorted(daemons), r.body
        for pod in ("rogue", "listener"):
            calls = http("GET", f"http://{ip[pod]}:8000/calls")
            assert calls["requests"] == calls["authorized"] == 0, (pod, calls)

        # The check itself, under the router's own Role: a slice the controller manages could still be
        # written by hand (it deletes those it does not own, but not at once), naming any Pod at any address.
        members = FleetMembers(config.new_client_from_config(config_file=str(kubeconfig)), "llm", ns)
        url = "http://{}:8000".format
        offered = [
            Endpoint(a_daemon, url(daemons[a_daemon]), daemons[a_daemon], a_daemon),
            Endpoint(
                a_daemon, url(ip["listener"]), ip["listener"], a_daemon
            ),  # a fleet pod's name, elsewhere
            Endpoint("listener", url(ip["listener"]), ip["listener"], "listener"),
            Endpoint("rogue", url(ip["rogue"]), ip["rogue"], "rogue"),
            Endpoint(f"{ip['listener']}:8000", url(ip["listener"]), ip["listener"], ""),  # no targetRef
        ]
        assert members.members(offered) == offered[:1]

        # The fleet's own pods come and go as they turn ready or not; none left, a reset is a 503.
        cluster.kubectl("patch", "infd", "llm", "-n", ns, "--type=merge", "-p", '{"spec":{"replicas":1}}')
        wait_for(lambda: len(pods()) == 1, 60, "one pod to leave")
        cluster.kubectl("patch", "infd", "llm", "-n", ns, "--type=merge", "-p", '{"spec":{"replicas":0}}')
        wait_for(lambda: pods() == [], 60, "the last pod to leave")
        r = router.request("POST", "/reset_prefix_cache", headers=router.admin())
        assert r.status == 503 and r.json()["error"]["code"] == "no_pods", r.body
    finally:
        if router is not None:
            stop_router(router)
