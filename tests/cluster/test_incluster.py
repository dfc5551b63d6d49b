"""Pods get what a kubelet gives them to talk to the API server.

The cluster here is started the way a user starts it, `make cluster-up` (with
NODE_AGENT=1: these tests are about what the node agent gives its pods) from a
shell whose PATH does not hold the venv, so these tests also prove that pods
find `kvpilot` without anyone editing PATH. Inside pods run the official
`kubernetes` client's `load_incluster_config()` and kopf's login handlers,
unchanged; RBAC and TokenReview on the real apiserver decide what the tokens are.
"""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sysconfig
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from kubernetes import client, config

from devcluster import mountns
from devcluster.podspec import SpecResolver
from support import ROOT
from support.procs import wait_for

pytestmark = pytest.mark.cluster
needs_mount_namespaces = pytest.mark.skipif(
    not mountns.available(), reason="the ServiceAccount folder at its standard path needs root (mountns.py)"
)

SA_PATH = "/var/run/secrets/kubernetes.io/serviceaccount"
# Pods name the folder without spelling out SA_PATH: the agent rewrites a mountPath written in a
# command to its local folder (docs/cluster.md), and these tests are about the path itself.
IN_SA_PARENT = "cd /var/run/secrets/kubernetes.io/ &&"

# Runs inside a pod with the venv's python3; prints one JSON line.
IN_CLUSTER = textwrap.dedent(
    """
    import json, logging, os, socket, ssl, urllib.request
    import kopf
    from kubernetes import client, config

    config.load_incluster_config()
    core = client.CoreV1Api()
    ns = open("/var/run/secrets/kubernetes.io/" + "serviceaccount/namespace").read()  # see IN_SA_PARENT
    out = {"host": os.environ["KUBERNETES_SERVICE_HOST"], "port": os.environ["KUBERNETES_SERVICE_PORT"],
           "namespace": ns, "pods": sorted(p.metadata.name for p in core.list_namespaced_pod(ns).items)}
    try:
        core.list_namespaced_secret(ns)
        out["secrets"] = 200
    except client.ApiException as e:
        out["secrets"] = e.status
    info = kopf.login_via_client(logger=logging.getLogger(), settings=kopf.OperatorSettings())
    out["kopf_server"], out["kopf_token"] = info.server, bool(info.token)
    out["hostname"] = socket.gethostname()
    # kopf's fallback login: the token file and https://kubernetes.default.svc, by name.
    sa = kopf.login_with_service_account(settings=kopf.OperatorSettings())
    if out["port"] == "443":
        req = urllib.request.Request(f"{sa.server}/api/v1/namespaces/{ns}/pods",
                                     headers={"Authorization": f"Bearer {sa.token}"})
        ctx = ssl.create_default_context(cafile=sa.ca_path)
        with urllib.request.urlopen(req, context=ctx, timeout=10) as resp:
            out["by_name"] = resp.status
    print(json.dumps(out), flush=True)
    """
)


def user_env() -> dict[str, str]:
    """A fresh shell's environment: no venv activated, no venv on PATH."""
    venv_bin = sysconfig.get_path("scripts")
    path = [p for p in os.environ.get("PATH", "/usr/bin:/bin").split(os.pathsep) if p and p != venv_bin]
    drop = {"VIRTUAL_ENV", "PYTHONPATH", "KUBECONFIG"}
    return {**{k: v for k, v in os.environ.items() if k not in drop}, "PATH": os.pathsep.join(path)}


@pytest.fixture(scope="module")
def api(tmp_path_factory: pytest.TempPathFactory) -> Iterator[client.ApiClient]:
    """A cluster from `make cluster-up NODE_AGENT=1`, as docs/cluster.md tells a user; `make cluster-down` after."""
    state = tmp_path_factory.mktemp("user-cluster")
    make = ["make", "-s", "-C", str(ROOT), f"CLUSTER_DIR={state}", "NODE_AGENT=1"]
    up = subprocess.run([*make, "cluster-up"], env=user_env(), capture_output=True, text=True, timeout=300)
    try:
        assert up.returncode == 0, up.stdout + up.stderr
        yield config.new_client_from_config(config_file=str(state / "kubeconfig"))
    finally:
        subprocess.run([*make, "cluster-down"], env=user_env(), capture_output=True, timeout=120)


@pytest.fixture
def ns(api: client.ApiClient, request: pytest.FixtureRequest) -> Iterator[str]:
    core = client.CoreV1Api(api)
    name = "ic-" + request.node.name.replace("_", "-").lower()[5:40].strip("-")
    core.create_namespace({"metadata": {"name": name}})
    wait_for(lambda: core.read_namespaced_service_account("default", name), 30, "the default ServiceAccount")
    yield name
    core.delete_namespace(name)


def pod(name: str, argv: list[str], sa: str | None = None, **spec: object) -> dict:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name},
        "spec": {
            "restartPolicy": "Never",
            "terminationGracePeriodSeconds": 1,
            **({"serviceAccountName": sa} if sa else {}),
            "containers": [{"name": "main", "image": "kvpilot", "command": argv}],
            **spec,
        },
    }


def finished(core: client.CoreV1Api, ns: str, name: str, timeout: float = 90) -> str:
    """Wait for a pod to end; return its log (through the node agent's log endpoint)."""

    def done() -> str | None:
        return core.read_namespaced_pod(name, ns).status.phase in ("Succeeded", "Failed")

    wait_for(done, timeout, f"pod {name} to finish")
    logs = core.read_namespaced_pod_log(name, ns)
    assert core.read_namespaced_pod(name, ns).status.phase == "Succeeded", logs
    return logs


def token_user(api: client.ApiClient, token: str) -> str:
    """Who the apiserver says a token belongs to (TokenReview)."""
    review = client.AuthenticationV1Api(api).create_token_review({"spec": {"token": token}})
    assert review.status.authenticated, review.status.error
    return review.status.user.username


def test_pod_finds_kvpilot_without_path_edits(api: client.ApiClient, ns: str) -> None:
    core = client.CoreV1Api(api)
    core.create_namespaced_pod(ns, pod("help", ["kvpilot", "--help"]))
    assert "usage: kvpilot" in finished(core, ns, "help")


@needs_mount_namespaces
def test_in_cluster_client_and_kopf_log_in_with_the_pods_service_account(
    api: client.ApiClient, ns: str
) -> None:
    core, rbac = client.CoreV1Api(api), client.RbacAuthorizationV1Api(api)
    core.create_namespaced_service_account(ns, {"metadata": {"name": "reader"}})
    rbac.create_namespaced_role(
        ns,
        {
            "metadata": {"name": "pod-reader"},
            "rules": [{"apiGroups": [""], "resources": ["pods"], "verbs": ["list"]}],
        },
    )
    rbac.create_namespaced_role_binding(
        ns,
        {
            "metadata": {"name": "reader"},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "pod-reader"},
            "subjects": [{"kind": "ServiceAccount", "name": "reader", "namespace": ns}],
        },
    )
    core.create_namespaced_pod(ns, pod("client", ["python3", "-c", IN_CLUSTER], sa="reader"))
    # kubectl's in-cluster mode too (what helm test hooks and scripts in pods use).
    kubectl = "kubectl get pods -o name; kubectl get secrets 2>&1; true"
    core.create_namespaced_pod(ns, pod("kubectl", ["sh", "-c", kubectl], sa="reader"))
    out = json.loads(finished(core, ns, "client").strip().splitlines()[-1])
    assert out["namespace"] == ns
    assert set(out["pods"]) <= {"client", "kubectl"} and "client" in out["pods"]  # allowed by the Role...
    assert out["secrets"] == 403  # ...and nothing more
    assert out["kopf_token"] and out["kopf_server"] == f"https://{out['host']}:{out['port']}"
    if not out["host"].startswith("127."):  # a pod in its own network namespace: the bridge, port 443
        assert out["port"] == "443"
        assert out["by_name"] == 200  # kubernetes.default.svc resolves (pod's /etc/hosts), TLS verifies
        assert out["hostname"] == "client"  # its own UTS namespace, named after the pod
    said = finished(core, ns, "kubectl")
    assert "pod/kubectl" in said and "forbidden" in said.lower()


@needs_mount_namespaces
def test_each_pod_sees_only_its_own_token(api: client.ApiClient, ns: str) -> None:
    core = client.CoreV1Api(api)
    for sa in ("alpha", "beta"):
        core.create_namespaced_service_account(ns, {"metadata": {"name": sa}})
    show = ["sh", "-c", f"{IN_SA_PARENT} cat serviceaccount/token; echo; ls serviceaccount"]
    core.create_namespaced_pod(ns, pod("a", show, sa="alpha"))
    core.create_namespaced_pod(ns, pod("b", show, sa="beta"))
    core.create_namespaced_pod(
        ns,
        pod(
            "none",
            ["sh", "-c", f"{IN_SA_PARENT} ls -A serviceaccount; env"],
            sa="alpha",
            automountServiceAccountToken=False,
        ),
    )
    seen, tokens = {}, set()
    for name in ("a", "b"):
        token, *files = finished(core, ns, name).split()
        assert sorted(files) == ["ca.crt", "namespace", "token"]
        seen[name] = token_user(api, token)
        tokens.add(token)
    assert seen == {"a": f"system:serviceaccount:{ns}:alpha", "b": f"system:serviceaccount:{ns}:beta"}
    # automountServiceAccountToken: false -> the folder is empty (the host's stays hidden), env still set.
    lines = finished(core, ns, "none").split()
    assert not any(line.startswith("token") or line == "ca.crt" for line in lines)
    assert any(line.startswith("KUBERNETES_SERVICE_HOST=") for line in lines)
    # The host itself sees no pod's token at that path (nor its own, if it is a pod somewhere).
    host_token = Path(SA_PATH, "token")
    assert not host_token.exists() or host_token.read_text() not in tokens


def test_projected_token_is_renewed(api: client.ApiClient, ns: str, tmp_path: Path) -> None:
    core = client.CoreV1Api(api)
    core.create_namespaced_pod(ns, pod("long", ["sleep", "600"]))
    wait_for(lambda: core.read_namespaced_pod("long", ns).status.phase == "Running", 60, "pod long to run")
    spec = json.loads(core.read_namespaced_pod("long", ns, _preload_content=False).data)
    # The node agent's own renewal path, driven with a clock past the 80% mark.
    resolver = SpecResolver(core, spec, tmp_path)
    resolver.prepare_volumes()
    (token,) = resolver.tokens
    first = token.path.read_text()
    resolver.refresh_tokens(now=token.refresh_at - 1)
    assert token.path.read_text() == first, "renewed before it was due"
    time.sleep(1.1)  # tokens carry whole-second timestamps: a later one differs
    resolver.refresh_tokens(now=token.refresh_at + 1)
    second = token.path.read_text()
    assert second != first
    claims = json.loads(base64.urlsafe_b64decode(second.split(".")[1] + "=="))
    assert claims["kubernetes.io"]["pod"]["name"] == "long"  # bound to the pod, as the kubelet's are
    assert token_user(api, second) == f"system:serviceaccount:{ns}:default"
