"""InferenceDeployment spec.router through the real parts: the operator (with only rbac.cluster_role()) makes the
router's Deployment, Service, ServiceAccount and RoleBinding (to the routers' ClusterRole); the router pod
(`kvpilot router --fleet`, in-cluster credentials) finds two real daemons through the fleet Service's
EndpointSlices and follows their KV events; requests through the router's Service land where the prefix is
cached, and a reset through it, as AIPerf `--reset-kv-cache` sends it, reaches every daemon."""

from __future__ import annotations

import base64
import json
import urllib.error
import urllib.request

import pytest

from support.cluster import Cluster
from support.operator import (
    PROMPT,
    OperatorProcess,
    apply_ns,
    fleet,
    fleet_pods,
    http,
    infd,
    service_endpoints,
    standin_spec,
)
from support.procs import wait_for

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(600)]

ROUTER_OBJECTS = ("deployment", "service", "serviceaccount", "rolebinding")


def service_address(cluster: Cluster, ns: str, service: str) -> str:
    """host:port of a ready endpoint of the Service, as kube-proxy would pick one (the dev cluster has no
    kube-proxy or DNS: the Service's EndpointSlices are what it would read)."""
    slices = cluster.kubectl_json(
        "get", "endpointslices", "-n", ns, "-l", f"kubernetes.io/service-name={service}"
    )
    for s in slices["items"]:
        port = s["ports"][0]["port"]
        for ep in s.get("endpoints") or []:
            if (ep.get("conditions") or {}).get("ready"):
                return f"{ep['addresses'][0]}:{port}"
    raise AssertionError(f"Service {ns}/{service} has no ready endpoint: {slices['items']}")


def post(url: str, body: dict | None, token: str | None = None) -> tuple[int, dict, dict]:
    headers = {"Content-Type": "application/json"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    data = json.dumps(body).encode() if body is not None else b""
    req = urllib.request.Request(url, data=data, method="POST", headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, dict(r.headers), json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), json.loads(e.read() or b"null")


def test_router_serves_the_fleet_and_resets_every_pod(
    cluster: Cluster, namespace: str, operator: OperatorProcess
) -> None:
    ns = namespace
    apply_ns(
        cluster,
        ns,
        fleet(
            "llm",
            {
                "replicas": 2,
                "router": {"enabled": True},
                "engine": {"kvCacheBlocks": 256, "maxNumSeqs": 4, "maxModelLen": 512},
            },
        ),
    )
    cluster.kubectl("wait", "--for=condition=Ready", "infd/llm", "-n", ns, "--timeout=300s")
    st = infd(cluster, ns, "llm")["status"]
    assert st["endpoint"] == f"http://llm-router.{ns}.svc:8080"
    # updatedReplicas kept: the CRD's schema names it (a field it did not name was pruned by the API server)
    assert st["router"] == {"replicas": 1, "readyReplicas": 1, "updatedReplicas": 1, "service": "llm-router"}
    daemons = {p["metadata"]["name"]: p["status"]["podIP"] for p in fleet_pods(cluster, ns, "llm")}
    assert len(daemons) == 2
    # The router pod is not a daemon: the fleet Service (and so resets and the router itself) never sees it.
    assert set(service_endpoints(cluster, ns, "llm")) == set(daemons)
    for kind in ROUTER_OBJECTS:
        obj = cluster.kubectl_json("get", kind, "llm-router", "-n", ns)
        assert obj["metadata"]["ownerReferences"][0]["name"] == "llm", kind

    router = "http://" + service_address(cluster, ns, "llm-router")
    secret = cluster.kubectl_json("get", "secret", "llm-admin-token", "-n", ns)
    token = base64.b64decode(secret["data"]["token"]).decode()

    # The same long prompt twice through the router: the second lands on the pod that cached it.
    body = {"model": "SmolLM2-135M-Instruct", "prompt": PROMPT, "max_tokens": 1, "temperature": 0}
    code, h1, _ = post(f"{router}/v1/completions", body)
    assert code == 200 and h1["X-Kvpilot-Pod"] in daemons

    def second_hits() -> bool:
        code, h2, r = post(f"{router}/v1/completions", body)
        assert code == 200
        return (
            h2["X-Kvpilot-Pod"] == h1["X-Kvpilot-Pod"]
            and r["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        )

    # (the first request's KV events reach the router asynchronously: allow it a moment)
    wait_for(second_hits, 30, "a repeated prompt routed to the pod that caches it", interval=0.5)
    # ...as the router's index says, built from the pod's KV events over CURVE with the fleet's keys (the
    # daemons let no other key in: tests/router/test_kv_privacy.py).
    indexed = {p["pod"]: p["indexed_blocks"] for p in http("GET", f"{router}/health")["pods"]}
    assert indexed[h1["X-Kvpilot-Pod"]] > 0, indexed

    epochs = {n: http("GET", f"http://{ip}:8000/prefix_cache")["epoch"] for n, ip in daemons.items()}
    # AIPerf --reset-kv-cache: POST /reset_prefix_cache to the URL it benchmarks, with its API key as Bearer.
    assert post(f"{router}/reset_prefix_cache", None)[0] == 401
    code, _, answer = post(f"{router}/reset_prefix_cache", None, token)
    assert code == 200 and answer["success"], answer
    assert {p["pod"] for p in answer["pods"]} == set(daemons)
    for n, ip in daemons.items():
        assert http("GET", f"http://{ip}:8000/prefix_cache")["epoch"] == epochs[n] + 1, n
    code, _, r = post(f"{router}/v1/completions", body)
    assert code == 200 and r["usage"]["prompt_tokens_details"]["cached_tokens"] == 0

    # Drift is put back: a deleted RoleBinding (the router would lose its EndpointSlices) comes back.
    uid = cluster.kubectl_json("get", "rolebinding", "llm-router", "-n", ns)["metadata"]["uid"]
    cluster.kubectl("delete", "rolebinding", "llm-router", "-n", ns)
    wait_for(
        lambda: (
            (
                cluster.kubectl(
                    "get",
                    "rolebinding",
                    "llm-router",
                    "-n",
                    ns,
                    "-o",
                    "jsonpath={.metadata.uid}",
                    check=False,
                ).stdout
                or uid
            )
            != uid
        ),
        60,
        "the RoleBinding to be made again",
    )

    # Turning the router off removes what the operator made for it, and the endpoint is the fleet's again.
    cluster.kubectl(
        "patch", "infd", "llm", "-n", ns, "--type=merge", "-p", '{"spec":{"router":{"enabled":false}}}'
    )
    wait_for(lambda: "router" not in infd(cluster, ns, "llm")["status"], 60, "status.router to go")
    assert infd(cluster, ns, "llm")["status"]["endpoint"] == f"http://llm.{ns}.svc:8000"
    for kind in ROUTER_OBJECTS:
        wait_for(
            lambda kind=kind: (
                cluster.kubectl("get", kind, "llm-router", "-n", ns, check=False).returncode != 0
            ),
            60,
            f"{kind} llm-router to be deleted",
        )
    args = cluster.kubectl_json("get", "deployment", "llm", "-n", ns)["spec"]["template"]["spec"][
        "containers"
    ][0]
    assert "--kv-events-endpoint" not in args["args"]


def test_router_specs_the_api_server_refuses(
    cluster: Cluster, namespace: str, operator: OperatorProcess
) -> None:
    cases = [
        (
            {"router": {"enabled": True}, "engine": {"dataParallelSize": 2}, "port": 5560},
            "ports 5557 to 5557 + 2",
        ),
        ({"router": {"enabled": True, "policy": "fastest"}}, "Unsupported value"),
        ({"router": {"enabled": True}, "port": 5558}, "ports 5557 to 5557 + 2"),
        ({"router": {"enabled": True, "replicas": -1}}, "should be greater than or equal to 0"),
        ({"env": [{"name": "POD_NAMESPACE", "value": "x"}]}, "set by the operator"),
    ]
    for spec, message in cases:
        doc = json.dumps({**fleet("bad", spec), "metadata": {"name": "bad", "namespace": namespace}})
        r = cluster.kubectl("apply", "-f", "-", input=doc, check=False)
        assert r.returncode != 0 and message in r.stderr, (spec, r.stderr)
    long = "x" * 57
    doc = json.dumps(
        {**fleet(long, {"router": {"enabled": True}}), "metadata": {"name": long, "namespace": namespace}}
    )
    r = cluster.kubectl("apply", "-f", "-", input=doc, check=False)
    assert r.returncode != 0 and "at most 56 characters" in r.stderr, r.stderr
    # A data-parallel fleet routed prefix-aware (each rank publishes its events), on a port past the ranks'.
    ok = {
        **fleet(
            "dp",
            {"replicas": 0, "router": {"enabled": True}, "port": 5561, "engine": {"dataParallelSize": 2}},
        ),
        "metadata": {"name": "dp", "namespace": namespace},
    }
    cluster.kubectl("apply", "-f", "-", input=json.dumps(ok))


def test_a_taken_name_is_reported_never_adopted(
    cluster: Cluster, namespace: str, operator: OperatorProcess
) -> None:
    ns = namespace
    cluster.kubectl("create", "serviceaccount", "llm2-router", "-n", ns)  # the user's own, by chance
    apply_ns(
        cluster,
        ns,
        fleet("llm2", {"replicas": 1, **standin_spec(), "router": {"enabled": True, "replicas": 0}}),
    )

    def ready_reason() -> str | None:
        conds = (infd(cluster, ns, "llm2").get("status") or {}).get("conditions") or []
        return next((c["reason"] for c in conds if c["type"] == "Ready"), None)

    wait_for(lambda: ready_reason() == "RouterNameConflict", 60, "Ready=False RouterNameConflict")
    sa = cluster.kubectl_json("get", "serviceaccount", "llm2-router", "-n", ns)
    assert not sa["metadata"].get("ownerReferences")  # untouched
    assert cluster.kubectl("get", "deployment", "llm2-router", "-n", ns, check=False).returncode != 0
    events = cluster.kubectl("get", "events", "-n", ns, "--field-selector", "involvedObject.name=llm2").stdout
    assert "RouterNameConflict" in events and "ServiceAccount llm2-router already exists" in events
    # The name freed (and the spec touched), the router is made.
    cluster.kubectl("delete", "serviceaccount", "llm2-router", "-n", ns)
    cluster.kubectl(
        "patch", "infd", "llm2", "-n", ns, "--type=merge", "-p", '{"spec":{"router":{"policy":"least-load"}}}'
    )
    wait_for(
        lambda: cluster.kubectl("get", "deployment", "llm2-router", "-n", ns, check=False).returncode == 0,
        60,
        "the router's Deployment",
    )
    for kind in ROUTER_OBJECTS:
        obj = cluster.kubectl_json("get", kind, "llm2-router", "-n", ns)
        assert obj["metadata"]["ownerReferences"][0]["name"] == "llm2", kind
