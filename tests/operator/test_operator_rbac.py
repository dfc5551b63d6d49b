"""The operator with exactly its rbac.py rules against an API server that enforces OwnerReferencesPermissionEnforcement
(as OpenShift and many hardened clusters do): owner references that block deletion need
`inferencedeployments/finalizers: update`. No nodes: the objects the operator writes are the point."""

from __future__ import annotations

import copy
import json
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from devcluster import ControlPlane
from kvpilot.operator import rbac
from support import ROOT
from support.operator import OperatorProcess
from support.procs import wait_for

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(600)]

PLUGIN = "--enable-admission-plugins=OwnerReferencesPermissionEnforcement"
KUBECTL = shutil.which("kubectl") or "/usr/bin/kubectl"


@pytest.fixture(scope="module")
def enforcing(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ControlPlane]:
    cp = ControlPlane(workdir=tmp_path_factory.mktemp("enforcing") / "cp", apiserver_args=(PLUGIN,))
    cp.start(timeout=180)
    try:
        yield cp
    finally:
        cp.stop()


def kubectl(cp: ControlPlane, *args: str, input: str | None = None) -> str:
    r = subprocess.run(
        [KUBECTL, f"--kubeconfig={cp.kubeconfig}", *args],
        input=input,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, f"kubectl {' '.join(args)}: {r.stderr}"
    return r.stdout


def apply(cp: ControlPlane, *objs: dict) -> None:
    kubectl(cp, "apply", "-f", "-", input="\n---\n".join(yaml.safe_dump(o) for o in objs))


def test_owner_references_under_exactly_the_rules(enforcing: ControlPlane, tmp_path: Path) -> None:
    cp = enforcing
    kubectl(cp, "apply", "-f", str(ROOT / "crds"))
    kubectl(cp, "wait", "--for=condition=Established", "crd/inferencedeployments.kvpilot.io", "--timeout=60s")
    kubectl(cp, "create", "namespace", "kvpilot-system")
    kubectl(cp, "create", "namespace", "t")
    without_finalizers = rbac.cluster_role()
    without_finalizers["rules"] = [
        r for r in without_finalizers["rules"] if "inferencedeployments/finalizers" not in r["resources"]
    ]
    apply(
        cp,
        {
            "apiVersion": "v1",
            "kind": "ServiceAccount",
            "metadata": {"name": "kvpilot-operator", "namespace": "kvpilot-system"},
        },
        without_finalizers,
        rbac.cluster_role_binding("kvpilot-system"),
        rbac.router_cluster_role(),
    )
    token = kubectl(
        cp, "create", "token", "kvpilot-operator", "-n", "kvpilot-system", "--duration=1h"
    ).strip()
    kubeconfig = tmp_path / "kubeconfig"
    cfg = json.loads(cp.kubeconfig.read_text())
    cfg["users"] = [{"name": "op", "user": {"token": token}}]
    cfg["contexts"][0]["context"]["user"] = "op"
    kubeconfig.write_text(json.dumps(cfg))
    op = OperatorProcess(kubeconfig, tmp_path / "operator.log")
    op.start()
    try:
        fleet = {
            "apiVersion": "kvpilot.io/v1alpha1",
            "kind": "InferenceDeployment",
            "metadata": {"namespace": "t"},
            "spec": {"replicas": 1, "router": {"enabled": True}},
        }
        # Without the finalizers rule the plugin refuses the owned objects (which also shows it is on).
        apply(cp, copy.deepcopy(fleet) | {"metadata": {"name": "refused", "namespace": "t"}})
        wait_for(lambda: "cannot set blockOwnerDeletion" in op.log.read_text(), 60, "the plugin's refusal")
        # With exactly its rules every owned object is written.
        apply(cp, rbac.cluster_role())
        apply(cp, copy.deepcopy(fleet) | {"metadata": {"name": "owned", "namespace": "t"}})
        uid = json.loads(kubectl(cp, "get", "infd", "owned", "-n", "t", "-o", "json"))["metadata"]["uid"]
        # ... the router's too, its RoleBinding to the routers' ClusterRole included (`bind` on that role).
        router = [
            (kind, "owned-router") for kind in ("deployment", "service", "serviceaccount", "rolebinding")
        ]
        for kind, name in (
            ("deployment", "owned"),
            ("service", "owned"),
            ("secret", "owned-admin-token"),
            *router,
        ):

            def owned(kind: str = kind, name: str = name) -> bool:
                r = subprocess.run(
                    [KUBECTL, f"--kubeconfig={cp.kubeconfig}", "get", kind, name, "-n", "t", "-o", "json"],
                    capture_output=True,
                    text=True,
                    timeout=60,
                )
                refs = json.loads(r.stdout)["metadata"].get("ownerReferences") if r.returncode == 0 else None
                return bool(refs) and refs[0]["uid"] == uid and refs[0]["blockOwnerDeletion"] is True

            wait_for(owned, 60, f"{kind} {name} owned by the InferenceDeployment")
    finally:
        op.stop()
