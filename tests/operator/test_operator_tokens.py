"""Tokens stay in their fleet, through the real API server and the operator with only rbac.RULES: a fleet
mounts only a Secret that consents (labelled kvpilot.io/admin-token=true, or its own), never takes over a
Deployment or Service of its name that is someone else's, and no pod's reply body reaches a status."""

from __future__ import annotations

import base64
import json

import pytest

from support.cluster import Cluster
from support.operator import (
    OperatorProcess,
    apply_ns,
    fleet,
    infd,
    pcr,
    standin_fleet,
    standin_spec,
    wait_phase,
)
from support.procs import wait_for

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(600)]


def ready(cluster: Cluster, ns: str, name: str) -> dict:
    """The fleet's Ready condition ({} before the first status)."""
    conds = (infd(cluster, ns, name).get("status") or {}).get("conditions") or []
    return next((c for c in conds if c["type"] == "Ready"), {})


def exists(cluster: Cluster, kind: str, ns: str, name: str) -> bool:
    return cluster.kubectl("get", kind, name, "-n", ns, check=False).returncode == 0


def test_a_fleet_mounts_only_a_secret_that_consents(
    cluster: Cluster, ns: str, operator: OperatorProcess
) -> None:
    # Fleet "a" has its generated token; fleet "b" names a's Secret (a user who may create fleets but not read
    # Secrets would get a's token mounted into b's pods) and another team's unlabelled Secret.
    standin_fleet(cluster, ns, "a", replicas=1)
    cluster.kubectl("create", "secret", "generic", "theirs", "-n", ns, "--from-literal=token=their-token")
    for name, secret in (("b", "a-admin-token"), ("c", "theirs")):
        spec = {"replicas": 1, **standin_spec(), "adminTokenSecretRef": {"name": secret}}
        apply_ns(cluster, ns, fleet(name, spec))
    for name, secret in (("b", "a-admin-token"), ("c", "theirs")):
        wait_for(
            lambda n=name: ready(cluster, ns, n).get("reason") == "AdminTokenNotAllowed",
            60,
            f"{name} refused",
        )
        cond = ready(cluster, ns, name)
        assert cond["status"] == "False" and secret in cond["message"], cond
        assert not exists(cluster, "deployment", ns, name), f"{name}'s pods were made with {secret}"
    events = cluster.kubectl("get", "events", "-n", ns, "--field-selector", "involvedObject.name=b").stdout
    assert "AdminTokenNotAllowed" in events
    # A reset of the refused fleet sends nothing either: the same rule, from the same place.
    apply_ns(cluster, ns, pcr("via-b", {"targetRef": {"name": "b"}}))
    st = wait_phase(cluster, ns, "via-b", 30)["status"]
    cond = next(c for c in st["conditions"] if c["type"] == "Failed")
    assert (st["phase"], cond["reason"]) == ("Failed", "AdminTokenNotAllowed"), st

    # Its owner labels the Secret: the fleet rolls out with it (seen on the operator's retry).
    cluster.kubectl("label", "secret", "theirs", "-n", ns, "kvpilot.io/admin-token=true")
    wait_for(lambda: ready(cluster, ns, "c").get("status") == "True", 120, "c rolled out once consented")
    env = cluster.kubectl_json("get", "deployment", "c", "-n", ns)["spec"]["template"]["spec"]["containers"][
        0
    ]["env"]
    assert {
        "name": "KVPILOT_ADMIN_TOKEN",
        "valueFrom": {"secretKeyRef": {"name": "theirs", "key": "token"}},
    } in env


def test_a_fleet_never_takes_over_a_deployment_or_service_of_its_name(
    cluster: Cluster, ns: str, operator: OperatorProcess
) -> None:
    cluster.kubectl("create", "deployment", "web", "-n", ns, "--image=someone/else", "--replicas=0")
    cluster.kubectl("create", "service", "clusterip", "api", "-n", ns, "--tcp=80:8080")
    for name in ("web", "api"):
        apply_ns(cluster, ns, fleet(name, {"replicas": 1, **standin_spec()}))
    for name, kind in (("web", "Deployment"), ("api", "Service")):
        wait_for(
            lambda n=name: ready(cluster, ns, n).get("reason") == "NameConflict", 60, f"{name}: NameConflict"
        )
        assert f"{kind} {name} already exists" in ready(cluster, ns, name)["message"]
    dep = cluster.kubectl_json("get", "deployment", "web", "-n", ns)
    assert not dep["metadata"].get("ownerReferences"), dep["metadata"]
    assert dep["spec"]["template"]["spec"]["containers"][0]["image"] == "someone/else"
    assert dep["spec"]["replicas"] == 0
    svc = cluster.kubectl_json("get", "service", "api", "-n", ns)
    assert not svc["metadata"].get("ownerReferences") and svc["spec"]["ports"][0]["port"] == 80, svc
    assert not exists(cluster, "deployment", ns, "api")  # nothing of a fleet whose Service is taken
    # The name freed, the fleet is made.
    cluster.kubectl("delete", "deployment", "web", "-n", ns)
    wait_for(lambda: ready(cluster, ns, "web").get("status") == "True", 120, "web rolled out once freed")
    owners = cluster.kubectl_json("get", "deployment", "web", "-n", ns)["metadata"]["ownerReferences"]
    assert owners[0]["kind"] == "InferenceDeployment" and owners[0]["name"] == "web"


def test_no_pod_reply_body_reaches_the_reset_status(
    cluster: Cluster, ns: str, operator: OperatorProcess
) -> None:
    # One pod echoes the request's headers (its Bearer token among them), one answers a 2 MiB error.
    standin_fleet(cluster, ns, "echo", replicas=1, env=[{"name": "STANDIN_REPLY", "value": "echo-headers"}])
    standin_fleet(cluster, ns, "big", replicas=1, env=[{"name": "STANDIN_REPLY", "value": "big"}])
    spec = {"retriesPerPod": 1, "timeoutSeconds": 30}
    for name in ("echo", "big"):
        apply_ns(cluster, ns, pcr(f"flush-{name}", {**spec, "targetRef": {"name": name}}))
    token = base64.b64decode(
        cluster.kubectl_json("get", "secret", "echo-admin-token", "-n", ns)["data"]["token"]
    ).decode()
    for name, code in (("echo", 400), ("big", 500)):
        obj = wait_phase(cluster, ns, f"flush-{name}", 60)
        raw = json.dumps(obj)
        assert token not in raw and len(raw) < 16384, raw[:2000]
        (pod,) = obj["status"]["pods"]
        assert pod["result"] == "Failed" and pod["httpStatus"] == code, pod
        assert len(pod["message"]) < 300, pod["message"][:400]
        if name == "echo":
            assert "bad request" in pod["message"] and "Authorization: [redacted]" in pod["message"], pod
        events = cluster.kubectl("get", "events", "-n", ns, "-o", "json").stdout
        assert token not in events
