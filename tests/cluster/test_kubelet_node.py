"""The project's image as pods of the real kubelet, containerd and runc, with kube-proxy
(devcluster.kubeletnode; docs/cluster.md#real-nodes). The chart's operator
as a container, in-cluster through the `kubernetes` Service; the image's entrypoint and user, its cgroup
limits setting the daemon's threads, the kubelet's probes and restarts, `kubectl logs` and `kubectl exec`
through the kubelet, resets across them (one while `crictl stop` has the kubelet restart the daemon), a node
whose kubelet died, and `helm test`."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from chart.tools import CHART, Helm

from support.cluster import Cluster, kubelet_cluster, manifest, needs_kubelet_node
from support.operator import (
    apply_ns,
    cached_tokens,
    create_namespace,
    fleet,
    fleet_pods,
    pcr,
    pods_by_name,
    ready_replicas,
)
from support.procs import wait_for

pytestmark = [
    pytest.mark.timeout(1500),
    needs_kubelet_node,
]

NS = "real"


@pytest.fixture(scope="module")
def real(project_image: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    with kubelet_cluster(tmp_path_factory.mktemp("kubelet-cluster"), images=(project_image,)) as c:
        yield c


@pytest.fixture(scope="module")
def operator(real: Cluster, project_image: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    """README's Helm block on the real nodes: the operator as a container of the image, reaching the API server
    at the `kubernetes` Service through kube-proxy, as on any cluster; its pod's name."""
    cluster = real
    helm = Helm(tmp_path_factory.mktemp("helm"), cluster.kubeconfig)
    repository, tag = project_image.rsplit(":", 1)
    helm(
        "install", "kvpilot", str(CHART), "-n", "kvpilot-system", "--create-namespace", "--wait", "--timeout=5m",
        "--set", f"image.repository={repository}", "--set", f"image.tag={tag}", "--set", "image.pullPolicy=Never",
        timeout=400,
    )  # fmt: skip
    (pod,) = cluster.kubectl_json(
        "get", "pods", "-n", "kvpilot-system", "-l", "app.kubernetes.io/name=kvpilot"
    )["items"]
    assert pod["status"]["phase"] == "Running", pod["status"]
    return pod["metadata"]["name"]


@pytest.fixture(scope="module")
def llm(real: Cluster, operator: str, project_image: str) -> dict[str, str]:
    """A one-pod fleet of the project's image, limited to one CPU; pod name -> IP once Ready."""
    cluster = real
    create_namespace(cluster, NS)
    spec = {
        "replicas": 1,
        "image": project_image,
        "imagePullPolicy": "Never",  # no registry: the image is in the node's containerd or nowhere
        "resources": {"limits": {"cpu": "1", "memory": "3Gi"}},
        "engine": {"kvCacheBlocks": 256, "maxNumSeqs": 4, "maxModelLen": 512},
    }
    apply_ns(cluster, NS, fleet("llm", spec))
    wait_for(lambda: ready_replicas(cluster, NS, "llm", 1), 300, "the fleet's pod Ready", interval=1)
    return {p["metadata"]["name"]: p["status"]["podIP"] for p in fleet_pods(cluster, NS, "llm")}


def test_nodes_are_the_real_kubelet_on_containerd(real: Cluster) -> None:
    cluster = real
    wide = cluster.kubectl("get", "nodes", "-o", "wide").stdout
    assert "containerd://" in wide and "v1.37.2" in wide and " Ready " in wide, wide
    node = cluster.kubectl_json("get", "node", "node-1")
    assert node["status"]["nodeInfo"]["kubeletVersion"] == "v1.37.2"
    assert node["status"]["capacity"]["nvidia.com/gpu"] == "1", "GPU requests must schedule as on a GPU node"


def test_the_image_serves_as_a_pod_with_logs_exec_and_its_cpu_limit(
    real: Cluster, llm: dict[str, str]
) -> None:
    cluster = real
    ((pod, ip),) = llm.items()
    cached_tokens(ip)
    assert cached_tokens(ip) > 0, "the second request should hit the warm cache"
    logs = cluster.kubectl("logs", pod, "-n", NS).stdout
    # The container's CFS quota (limits.cpu: 1), read by the daemon: one torch thread.
    assert "1 torch threads" in logs, logs[-3000:]
    # The hint a newcomer reads names the image's command as it is typed there (it is on PATH).
    assert "or `kvpilot bench --url http://" in logs, logs[-3000:]
    out = cluster.kubectl(
        "exec", pod, "-n", NS, "--", "sh", "-c", "id -u; cat /sys/fs/cgroup/cpu/cpu.cfs_quota_us"
    ).stdout
    assert out.split() == ["10001", "100000"], out


def test_a_fleet_reset_through_the_kubelets_pods_and_a_restart(real: Cluster, llm: dict[str, str]) -> None:
    cluster = real
    ((pod, ip),) = llm.items()
    cached_tokens(ip)
    apply_ns(cluster, NS, pcr("flush", {"targetRef": {"name": "llm"}}))
    cluster.kubectl("wait", "--for=condition=Complete", "pcr/flush", "-n", NS, "--timeout=120s")
    st = cluster.kubectl_json("get", "pcr", "flush", "-n", NS)
    assert (st["status"]["phase"], st["status"]["succeeded"]) == ("Succeeded", 1), st["status"]
    assert pods_by_name(st)[pod]["result"] == "Succeeded"
    assert cached_tokens(ip) == 0, "nothing cached before the reset may be reused"

    # The daemon stopped (SIGTERM to the container's PID 1): the kubelet starts it again, and the probe
    # holds it out of Ready until it serves.
    cluster.kubectl("exec", pod, "-n", NS, "--", "sh", "-c", "kill 1")

    def restarted() -> bool:
        status = cluster.kubectl_json("get", "pod", pod, "-n", NS)["status"]["containerStatuses"][0]
        return status["restartCount"] >= 1 and status["ready"]

    wait_for(restarted, 180, "the kubelet to restart the daemon", interval=1)
    previous = cluster.kubectl("logs", pod, "-n", NS, "--previous").stdout
    assert "stopped" in previous, previous[-2000:]
    apply_ns(cluster, NS, pcr("after-restart", {"targetRef": {"name": "llm"}}))
    cluster.kubectl("wait", "--for=condition=Complete", "pcr/after-restart", "-n", NS, "--timeout=120s")
    st = cluster.kubectl_json("get", "pcr", "after-restart", "-n", NS)
    assert st["status"]["phase"] == "Succeeded", st["status"]


def test_a_container_stopped_by_crictl_mid_reset_is_waited_for_then_reset(
    real: Cluster, llm: dict[str, str]
) -> None:
    """`crictl stop` of the daemon's container, a reset created at once: the pod is Ready in the API a moment
    longer, its daemon gone. The reset must not fail it: the kubelet restarts the container, the pod is starting
    (not Ready since its container started), the reset waits for it and resets the new daemon."""
    cluster = real
    (node,) = cluster.nodes
    ((pod, ip),) = llm.items()
    cached_tokens(ip)

    def daemon() -> dict:
        return cluster.kubectl_json("get", "pod", pod, "-n", NS)["status"]["containerStatuses"][0]

    before = daemon()["restartCount"]
    ready = node.crictl("pods", "--name", pod, "--namespace", NS, "--state", "ready", "-q")
    (sandbox,) = ready.stdout.split()
    (container,) = node.crictl("ps", "--pod", sandbox, "--name", "kvpilot", "-q").stdout.split()
    node.crictl("stop", container)
    apply_ns(cluster, NS, pcr("mid-restart", {"targetRef": {"name": "llm"}, "timeoutSeconds": 240}))
    cluster.kubectl(
        "wait", "--for=jsonpath={.status.completionTime}", "pcr/mid-restart", "-n", NS, "--timeout=300s"
    )
    st = cluster.kubectl_json("get", "pcr", "mid-restart", "-n", NS)
    assert pods_by_name(st)[pod]["result"] == "Succeeded", st["status"]
    assert st["status"]["phase"] == "Succeeded", st["status"]
    status = daemon()
    assert status["restartCount"] == before + 1 and status["ready"], status
    assert cached_tokens(ip) == 0, "the restarted daemon was reset"


def test_a_weight_update_the_daemons_user_cannot_read_fails_saying_why(
    real: Cluster, llm: dict[str, str]
) -> None:
    """A checkpoint path the image's user (uid 10001) may not read: each pod refuses it, 404 with the reason
    (it was a 500: the daemon's stat raised PermissionError unhandled), and serves on unchanged."""
    cluster = real
    ((pod, ip),) = llm.items()
    spec = {"targetRef": {"name": "llm"}, "modelPath": "/root/checkpoint", "version": "v9"}
    apply_ns(cluster, NS, manifest("kvpilot.io/v1alpha1", "WeightUpdate", "unreadable", spec))
    cluster.kubectl(
        "wait", "--for=jsonpath={.status.completionTime}", "wu/unreadable", "-n", NS, "--timeout=120s"
    )
    st = cluster.kubectl_json("get", "wu", "unreadable", "-n", NS)["status"]
    (record,) = st["pods"]
    assert (st["phase"], record["name"], record["result"]) == ("Failed", pod, "Failed"), st
    assert "HTTP 404" in record["message"] and "Permission denied" in record["message"], record
    cached_tokens(ip)  # it still serves


def test_a_reset_names_the_pods_of_a_node_whose_kubelet_died(real: Cluster, llm: dict[str, str]) -> None:
    """The kubelet killed: its containers run on, the control plane calls the node NotReady and its pods not
    Ready. They still hold their caches, so a reset calls them, and its status names each one."""
    cluster = real
    (node,) = cluster.nodes
    ((pod, ip),) = llm.items()
    cached_tokens(ip)
    node.stop_kubelet()
    try:

        def marked_not_ready() -> bool:
            conditions = cluster.kubectl_json("get", "pod", pod, "-n", NS)["status"]["conditions"]
            return any(c["type"] == "Ready" and c["status"] == "False" for c in conditions)

        wait_for(marked_not_ready, 90, "the node lifecycle controller to mark the pod not Ready", interval=1)
        node_ready = next(
            c
            for c in cluster.kubectl_json("get", "node", node.name)["status"]["conditions"]
            if c["type"] == "Ready"
        )
        assert node_ready["status"] == "Unknown", node_ready
        apply_ns(cluster, NS, pcr("kubelet-down", {"targetRef": {"name": "llm"}}))
        cluster.kubectl(
            "wait", "--for=jsonpath={.status.completionTime}", "pcr/kubelet-down", "-n", NS, "--timeout=120s"
        )
        st = cluster.kubectl_json("get", "pcr", "kubelet-down", "-n", NS)
        record = pods_by_name(st)[pod]
        assert (record["result"], record["node"]) == ("Succeeded", node.name), st["status"]
        assert cached_tokens(ip) == 0, "the daemon still ran and was reset"
    finally:
        node.start_kubelet()
    # The GPU the node advertised outlives its kubelet's restart.
    assert cluster.kubectl_json("get", "node", node.name)["status"]["capacity"].get("nvidia.com/gpu") == "1"


def test_the_operator_runs_as_a_pod_and_helm_test_passes(
    real: Cluster, operator: str, llm: dict[str, str], tmp_path: Path
) -> None:
    """The resets above were the operator pod's (no operator runs outside the cluster here); `helm test`'s pod
    reaches the API server in-cluster too."""
    cluster = real
    logs = cluster.kubectl("logs", "-n", "kvpilot-system", operator).stdout
    assert "flush" in logs and "kubelet-down" in logs, logs[-3000:]
    Helm(tmp_path / "helm", cluster.kubeconfig)("test", "kvpilot", "-n", "kvpilot-system", timeout=300)
