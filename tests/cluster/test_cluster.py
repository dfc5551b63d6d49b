"""The dev cluster behaves like Kubernetes where the operator will rely on it.

Everything here goes through the real kubectl binary or the official Python
client against the real apiserver; pods are real processes in real network
namespaces (loopback addresses when not root).
"""

from __future__ import annotations

import ipaddress
import json
import os
import subprocess
import textwrap
import time
import urllib.error
import urllib.request

import pytest
import yaml
from kubernetes import client

from support.cluster import NODES, Cluster, manifest
from support.procs import wait_for

pytestmark = pytest.mark.cluster


def workload(kind: str, name: str, pod_spec: str, replicas: int | None = None) -> str:
    """A Deployment or DaemonSet of pods labelled app=NAME, as YAML; `pod_spec` is their pod spec (YAML)."""
    pod = {"metadata": {"labels": {"app": name}}, "spec": yaml.safe_load(textwrap.dedent(pod_spec))}
    spec = {"selector": {"matchLabels": {"app": name}}, "template": pod}
    if replicas is not None:
        spec = {"replicas": replicas, **spec}
    return yaml.safe_dump(manifest("apps/v1", kind, name, spec), sort_keys=False)


WEB = textwrap.dedent(
    """
    apiVersion: v1
    kind: Secret
    metadata: {name: web-secret}
    stringData: {greeting: hello-from-secret, token: s3cr3t}
    ---
    """
) + workload(
    "Deployment",
    "web",
    replicas=3,
    pod_spec="""
    terminationGracePeriodSeconds: 5
    volumes:
    - name: conf
      secret: {secretName: web-secret}
    containers:
    - name: http
      image: python:3.11-slim   # ignored by the node agent
      command: [sh, -c]
      args:
      - >-
        echo "$(POD_NAME) $(POD_NAMESPACE) $TOKEN" > index.html &&
        cp /etc/web/greeting greeting.txt &&
        exec python3 -m http.server 8080 --bind "$POD_IP"
      env:
      - {name: POD_IP, valueFrom: {fieldRef: {fieldPath: status.podIP}}}
      - {name: POD_NAME, valueFrom: {fieldRef: {fieldPath: metadata.name}}}
      - {name: POD_NAMESPACE, valueFrom: {fieldRef: {fieldPath: metadata.namespace}}}
      - {name: TOKEN, valueFrom: {secretKeyRef: {name: web-secret, key: token}}}
      ports: [{name: http, containerPort: 8080}]
      volumeMounts: [{name: conf, mountPath: /etc/web}]
      readinessProbe:
        httpGet: {path: /, port: http}
        periodSeconds: 1
""",
)


def http_get(url: str, timeout: float = 2.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return resp.read().decode()


def pid_of(pod: client.V1Pod) -> int:
    cid = pod.status.container_statuses[0].container_id
    assert cid and cid.startswith("kvpilot://"), cid
    return int(cid.removeprefix("kvpilot://"))


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is dead too (it only waits to be reaped by its parent).
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def netns_names() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


def web_pods(cluster: Cluster, ns: str) -> list[client.V1Pod]:
    return cluster.core.list_namespaced_pod(ns, label_selector="app=web").items


@pytest.fixture(scope="session")
def cluster(agent_cluster: Cluster) -> Cluster:
    """This file is about the node agent (hack/lib/devcluster/nodeagent.py): its dev cluster, not the kubelet's."""
    return agent_cluster


@pytest.fixture(scope="module")
def web(cluster: Cluster) -> str:
    ns = "web"
    cluster.kubectl("create", "namespace", ns)
    wait_for(
        lambda: cluster.kubectl("get", "sa", "default", "-n", ns, check=False).returncode == 0,
        30,
        "default SA",
    )
    cluster.kubectl("apply", "-n", ns, "-f", "-", input=WEB)
    return ns


def test_version_nodes_and_leases(cluster: Cluster) -> None:
    version = json.loads(cluster.kubectl("version", "-o", "json").stdout)
    assert version["serverVersion"]["gitVersion"] == "v1.37.2"
    nodes = cluster.kubectl_json("get", "nodes")["items"]
    assert sorted(n["metadata"]["name"] for n in nodes) == list(NODES)
    for n in nodes:
        ready = {c["type"]: c["status"] for c in n["status"]["conditions"]}["Ready"]
        assert ready == "True"
        assert n["status"]["allocatable"]["nvidia.com/gpu"] == "1"
    lease = cluster.kubectl_json("get", "lease", "-n", "kube-node-lease", NODES[0])
    assert lease["spec"]["holderIdentity"] == NODES[0]


def test_deployment_becomes_available_and_pods_serve_http(cluster: Cluster, web: str) -> None:
    cluster.kubectl("rollout", "status", "deployment/web", "-n", web, "--timeout=90s")
    dep = cluster.apps.read_namespaced_deployment("web", web)
    available = {c.type: c.status for c in dep.status.conditions}["Available"]
    assert available == "True" and dep.status.ready_replicas == 3
    pods = web_pods(cluster, web)
    assert len(pods) == 3
    ips = {p.status.pod_ip for p in pods}
    assert len(ips) == 3, "each pod has its own IP"
    pod_range = ipaddress.ip_network(cluster.pod_cidr)
    service_range = ipaddress.ip_network("10.96.0.0/16")
    for p in pods:
        ip = ipaddress.ip_address(p.status.pod_ip)
        assert ip in pod_range and ip not in service_range
        assert p.status.phase == "Running" and p.status.host_ip
        assert p.status.pod_ips[0].ip == p.status.pod_ip
        assert p.spec.node_name in NODES
        cs = p.status.container_statuses[0]
        assert cs.ready and cs.state.running is not None and cs.restart_count == 0
        # Served by the pod's own process: env from fieldRef and secretKeyRef...
        assert http_get(f"http://{p.status.pod_ip}:8080/index.html").split() == [
            p.metadata.name,
            web,
            "s3cr3t",
        ]
        # ...and the secret volume, its mountPath rewritten to a local folder.
        assert http_get(f"http://{p.status.pod_ip}:8080/greeting.txt") == "hello-from-secret"
    # kubectl logs: apiserver -> the node agent's log endpoint -> the container's output.
    logs = cluster.kubectl("logs", pods[0].metadata.name, "-n", web).stdout
    assert '"GET /greeting.txt HTTP/1.1" 200' in logs
    if cluster.rootful:  # each pod lives in its own namespace, its IP on that namespace's eth0
        for p in pods:
            ns = cluster.netns_of(p)
            assert ns in netns_names()
            addr = subprocess.run(
                ["ip", "-n", ns, "-o", "addr", "show", "eth0"], capture_output=True, text=True
            )
            assert f" {p.status.pod_ip}/" in addr.stdout


def test_scale_down_stops_pods(cluster: Cluster, web: str) -> None:
    cluster.kubectl("rollout", "status", "deployment/web", "-n", web, "--timeout=90s")
    before = {p.metadata.name: p for p in web_pods(cluster, web)}
    cluster.kubectl("scale", "deployment/web", "-n", web, "--replicas=1")
    wait_for(lambda: len(web_pods(cluster, web)) == 1, 30, "scale down to 1 pod")
    (kept,) = web_pods(cluster, web)
    gone = [p for name, p in before.items() if name != kept.metadata.name]
    assert len(gone) == 2
    for p in gone:
        assert not pid_alive(pid_of(p)), f"process of deleted pod {p.metadata.name} still runs"
        with pytest.raises((urllib.error.URLError, OSError)):
            http_get(f"http://{p.status.pod_ip}:8080/", timeout=1)
    assert pid_alive(pid_of(kept))
    assert http_get(f"http://{kept.status.pod_ip}:8080/index.html").startswith(kept.metadata.name)
    if cluster.rootful:
        left = netns_names()
        assert cluster.netns_of(kept) in left
        assert not {cluster.netns_of(p) for p in gone} & left, (
            "the deleted pods' network namespaces are removed"
        )


def test_deleting_deployment_garbage_collects_pods(cluster: Cluster, web: str) -> None:
    pods = web_pods(cluster, web)
    assert pods, "the deployment should still have pods"
    pids = [pid_of(p) for p in pods]
    cluster.kubectl("delete", "deployment", "web", "-n", web, "--wait=false")
    # The garbage collector deletes the ReplicaSet, then its pods; the agent finalizes them.
    wait_for(
        lambda: not cluster.apps.list_namespaced_replica_set(web).items, 30, "ReplicaSet garbage collection"
    )
    wait_for(lambda: not web_pods(cluster, web), 30, "pod garbage collection")
    assert not any(pid_alive(pid) for pid in pids)


def test_service_account_without_rights_gets_403(cluster: Cluster, namespace: str) -> None:
    cluster.kubectl("create", "serviceaccount", "nobody", "-n", namespace)
    token = cluster.kubectl("create", "token", "nobody", "-n", namespace).stdout.strip()
    core = client.CoreV1Api(cluster.client_for_token(token))
    with pytest.raises(client.ApiException) as err:
        core.list_namespaced_pod(namespace)
    assert err.value.status == 403
    r = cluster.kubectl("get", "pods", "-n", namespace, token=token, check=False)
    assert r.returncode != 0 and "forbidden" in r.stderr.lower()
    # The static-token test user has no rights either...
    dev = client.CoreV1Api(cluster.client_for_token(cluster.cp.users["dev"].token))
    with pytest.raises(client.ApiException) as err:
        dev.list_namespaced_pod(namespace)
    assert err.value.status == 403
    # ...and RBAC really decides: a RoleBinding grants exactly what it says.
    cluster.kubectl("create", "role", "pod-reader", "--verb=list", "--resource=pods", "-n", namespace)
    cluster.kubectl(
        "create",
        "rolebinding",
        "nobody-reads",
        "--role=pod-reader",
        f"--serviceaccount={namespace}:nobody",
        "-n",
        namespace,
    )
    wait_for(lambda: core.list_namespaced_pod(namespace) is not None, 10, "the RoleBinding to apply")
    with pytest.raises(client.ApiException) as err:
        core.list_namespaced_secret(namespace)
    assert err.value.status == 403


DAEMONSET = workload(
    "DaemonSet",
    "agent",
    pod_spec="""
    terminationGracePeriodSeconds: 2
    containers:
    - name: sleeper
      image: busybox
      command: [sleep, "3600"]
""",
)


def test_daemonset_runs_one_pod_per_node(cluster: Cluster, namespace: str) -> None:
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=DAEMONSET)

    def ready() -> bool:
        st = cluster.apps.read_namespaced_daemon_set("agent", namespace).status
        return st.desired_number_scheduled == len(NODES) and st.number_ready == len(NODES)

    wait_for(ready, 60, "DaemonSet pods ready on every node")
    pods = cluster.core.list_namespaced_pod(namespace, label_selector="app=agent").items
    assert sorted(p.spec.node_name for p in pods) == list(NODES)
    assert all(pid_alive(pid_of(p)) for p in pods)


def test_gpu_requests_schedule_within_capacity(cluster: Cluster, namespace: str) -> None:
    def pod(name: str, gpus: int) -> dict:
        container = {
            "name": "main",
            "image": "vllm",
            "command": ["sleep", "3600"],
            "resources": {"limits": {"nvidia.com/gpu": str(gpus)}},
        }
        return manifest("v1", "Pod", name, {"terminationGracePeriodSeconds": 1, "containers": [container]})

    cluster.core.create_namespaced_pod(namespace, pod("one-gpu", 1))
    cluster.core.create_namespaced_pod(namespace, pod("too-many", 4))
    wait_for(
        lambda: cluster.core.read_namespaced_pod("one-gpu", namespace).status.phase == "Running",
        30,
        "the 1-GPU pod to run",
    )

    def unschedulable() -> client.V1PodCondition | None:
        conds = cluster.core.read_namespaced_pod("too-many", namespace).status.conditions or []
        return next((c for c in conds if c.type == "PodScheduled" and c.status == "False"), None)

    cond = wait_for(unschedulable, 10, "the 4-GPU pod to be marked unschedulable")
    assert cond.reason == "Unschedulable" and "Insufficient nvidia.com/gpu" in cond.message
    big = cluster.core.read_namespaced_pod("too-many", namespace)
    assert big.spec.node_name is None and big.status.phase == "Pending"


def test_restart_policy_and_grace_period(cluster: Cluster, namespace: str) -> None:
    def pod(name: str, script: str, policy: str, grace: int = 1) -> dict:
        container = {"name": "main", "image": "x", "command": ["sh", "-c", script]}
        spec = {"restartPolicy": policy, "terminationGracePeriodSeconds": grace, "containers": [container]}
        return manifest("v1", "Pod", name, spec)

    cluster.core.create_namespaced_pod(namespace, pod("crashy", "exit 3", "OnFailure"))
    cluster.core.create_namespaced_pod(namespace, pod("once", "exit 0", "Never"))
    cluster.core.create_namespaced_pod(
        namespace, pod("stubborn", 'trap "" TERM; sleep 600', "Always", grace=2)
    )
    wait_for(
        lambda: cluster.core.read_namespaced_pod("once", namespace).status.phase == "Succeeded",
        30,
        "a Never pod that exits 0 to succeed",
    )

    def restarted() -> bool:
        st = cluster.core.read_namespaced_pod("crashy", namespace).status
        return bool(st.container_statuses) and st.container_statuses[0].restart_count >= 1

    wait_for(restarted, 30, "an OnFailure pod that exits 3 to be restarted")
    wait_for(
        lambda: cluster.core.read_namespaced_pod("stubborn", namespace).status.phase == "Running",
        30,
        "stubborn",
    )
    stubborn = cluster.core.read_namespaced_pod("stubborn", namespace)
    pid = pid_of(stubborn)
    t0 = time.monotonic()
    cluster.core.delete_namespaced_pod("stubborn", namespace)
    # It ignores SIGTERM, so it lives for the 2 s grace period, then is SIGKILLed.

    def gone() -> bool:
        try:
            cluster.core.read_namespaced_pod("stubborn", namespace)
            return False
        except client.ApiException as e:
            return e.status == 404

    wait_for(gone, 20, "the pod deletion to be finalized")
    elapsed = time.monotonic() - t0
    assert 1.5 <= elapsed < 10, elapsed
    assert not pid_alive(pid)


def test_pod_waits_for_a_secret_created_later(cluster: Cluster, namespace: str) -> None:
    container = {
        "name": "main",
        "image": "x",
        "command": ["sh", "-c", 'test "$KEY" = late && exec sleep 600'],
        "env": [{"name": "KEY", "valueFrom": {"secretKeyRef": {"name": "late", "key": "k"}}}],
    }
    pod = manifest(
        "v1", "Pod", "needs-secret", {"terminationGracePeriodSeconds": 1, "containers": [container]}
    )
    cluster.core.create_namespaced_pod(namespace, pod)

    def waiting_reason() -> str | None:
        st = cluster.core.read_namespaced_pod("needs-secret", namespace).status
        cs = st.container_statuses or []
        return cs[0].state.waiting.reason if cs and cs[0].state.waiting else None

    assert wait_for(waiting_reason, 20, "the missing secret to be reported") == "CreateContainerConfigError"
    cluster.kubectl("create", "secret", "generic", "late", "--from-literal=k=late", "-n", namespace)
    wait_for(
        lambda: cluster.core.read_namespaced_pod("needs-secret", namespace).status.phase == "Running",
        20,
        "the pod to start once its secret exists",
    )
    st = cluster.core.read_namespaced_pod("needs-secret", namespace).status
    assert st.container_statuses[0].restart_count == 0
