"""spec.router.endpointPicker through a real API server: the operator (with only rbac.cluster_role()) makes the
fleet's InferencePool (inference.networking.k8s.io/v1) where that CRD is served, and says so when it is not.

GAIE's CRDs are not reachable here as a Go module or a download: tests/operator/gaie/inferencepools.yaml is a
copy written from GAIE's published v1 API (v1.6.0; its header says what from), installed and removed by this
test. No pod runs (the fleet and its router are scaled to zero): the objects the operator writes are the point.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from support.cluster import Cluster
from support.operator import OperatorProcess, apply_ns, fleet, infd, standin_spec
from support.procs import wait_for

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(300)]

POOL_CRD = Path(__file__).parent / "gaie" / "inferencepools.yaml"
CRD_NAME = "inferencepools.inference.networking.k8s.io"


def condition(cluster: Cluster, ns: str, name: str) -> dict | None:
    conds = (infd(cluster, ns, name).get("status") or {}).get("conditions") or []
    return next((c for c in conds if c["type"] == "InferencePoolReady"), None)


def pool(cluster: Cluster, ns: str, name: str) -> dict | None:
    r = cluster.kubectl(
        "get", "inferencepools.inference.networking.k8s.io", name, "-n", ns, "-o", "json", check=False
    )
    return json.loads(r.stdout) if r.returncode == 0 else None


def test_the_pool_follows_the_crd_and_the_spec(
    cluster: Cluster, namespace: str, operator: OperatorProcess
) -> None:
    ns = namespace
    assert cluster.kubectl("get", "crd", CRD_NAME, check=False).returncode != 0, (
        "the CRD is installed already"
    )
    spec = {
        "replicas": 0,
        **standin_spec(),
        "router": {"enabled": True, "replicas": 0, "endpointPicker": {"enabled": True}},
    }
    clash = {"router": {"enabled": True, "endpointPicker": {"enabled": True, "port": 8080}}}
    doc = json.dumps({**fleet("bad", clash), "metadata": {"name": "bad", "namespace": ns}})
    r = cluster.kubectl("apply", "-f", "-", input=doc, check=False)
    assert r.returncode != 0 and "port 8080 is the router's HTTP port" in r.stderr, r.stderr
    apply_ns(cluster, ns, fleet("gw", spec))

    # Without GAIE's CRD: the fleet and its router are made as ever, the condition says how to get the pool.
    cond = wait_for(lambda: condition(cluster, ns, "gw"), 60, "the InferencePoolReady condition")
    assert (cond["status"], cond["reason"]) == ("False", "CRDNotInstalled"), cond
    assert "manifests.yaml" in cond["message"] and CRD_NAME in cond["message"], cond
    svc = cluster.kubectl_json("get", "service", "gw-router", "-n", ns)
    assert {"name": "grpc-epp", "port": 9002} in [
        {k: p[k] for k in ("name", "port")} for p in svc["spec"]["ports"]
    ]
    args = cluster.kubectl_json("get", "deployment", "gw-router", "-n", ns)["spec"]["template"]["spec"][
        "containers"
    ][0]["args"]
    assert args[args.index("--endpoint-picker-port") + 1] == "9002"
    assert "inferencePool" not in infd(cluster, ns, "gw")["status"]
    assert operator.healthy()

    try:
        # The CRD installed later: no event of the fleet's follows, the CRD's own brings the pool.
        cluster.kubectl("apply", "-f", str(POOL_CRD))
        cluster.kubectl("wait", "--for=condition=Established", f"crd/{CRD_NAME}", "--timeout=60s")
        made = wait_for(lambda: pool(cluster, ns, "gw"), 60, "InferencePool gw")
        fleet_obj = infd(cluster, ns, "gw")
        (ref,) = made["metadata"]["ownerReferences"]  # garbage-collected with the fleet
        assert (ref["kind"], ref["uid"], ref["controller"]) == (
            "InferenceDeployment",
            fleet_obj["metadata"]["uid"],
            True,
        )
        assert made["spec"]["selector"] == {
            "matchLabels": {"kvpilot.io/inference-deployment": "gw", "kvpilot.io/serving": "true"}
        }
        assert made["spec"]["targetPorts"] == [{"number": 8000}]
        # the CRD's defaults filled in by the API server (group, failureMode) are kept by the operator's apply
        assert made["spec"]["endpointPickerRef"] == {
            "group": "",
            "kind": "Service",
            "name": "gw-router",
            "port": {"number": 9002},
            "failureMode": "FailClose",
        }
        wait_for(
            lambda: (condition(cluster, ns, "gw") or {}).get("status") == "True",
            30,
            "InferencePoolReady=True",
        )
        assert infd(cluster, ns, "gw")["status"]["inferencePool"] == "gw"

        # A spec change reaches the pool: the daemons' port and the picker's.
        patch = {"spec": {"port": 8001, "router": {"endpointPicker": {"port": 9100}}}}
        cluster.kubectl("patch", "infd", "gw", "-n", ns, "--type=merge", "-p", json.dumps(patch))

        def updated() -> bool:
            p = pool(cluster, ns, "gw") or {"spec": {}}
            return p["spec"].get("targetPorts") == [{"number": 8001}] and p["spec"]["endpointPickerRef"][
                "port"
            ] == {"number": 9100}

        wait_for(updated, 60, "the pool on ports 8001 and 9100")

        # The picker turned off: the pool goes, and with it the condition and the router's grpc-epp port.
        off = {"spec": {"router": {"endpointPicker": {"enabled": False}}}}
        cluster.kubectl("patch", "infd", "gw", "-n", ns, "--type=merge", "-p", json.dumps(off))
        wait_for(lambda: pool(cluster, ns, "gw") is None, 60, "InferencePool gw to be deleted")
        wait_for(lambda: condition(cluster, ns, "gw") is None, 30, "the condition to go")
        assert "inferencePool" not in infd(cluster, ns, "gw")["status"]
        svc = cluster.kubectl_json("get", "service", "gw-router", "-n", ns)
        assert [p["name"] for p in svc["spec"]["ports"]] == ["http"]
    finally:
        cluster.kubectl("delete", "crd", CRD_NAME, "--wait=true", check=False)
