"""The dev cluster for tests against a real API server (see docs/cluster.md).

The `cluster` fixture builds the binaries and the project's image if needed (cached), starts etcd,
kube-apiserver, kube-controller-manager and kube-scheduler in this process's control, and nodes of the real
kubelet, containerd and runc (devcluster.kubeletnode), then tears all of it down and puts the host back, also
when tests fail or pytest is interrupted.
"""

from __future__ import annotations

import contextlib
import json
import re
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client, config

from devcluster import ControlPlane
from devcluster.kubeletnode import NODE_MONITOR_GRACE_S, KubeletNode, cannot_run_here, kubelet_nodes
from support import ROOT
from support.procs import wait_for

KUBECTL = shutil.which("kubectl") or "/usr/bin/kubectl"
IMAGE_BUILD = ROOT / "hack" / "image" / "build.sh"


def readable_by_pods(folder: Path) -> Path:
    """`folder` and what it holds readable by every user: the image runs as uid 10001, and pytest's folders are
    root's alone (0700; safetensors writes 0600). A pod reaches a hostPath folder through its mount, not its
    parents, so the folder itself is enough."""
    for f in [folder, *folder.rglob("*")]:
        f.chmod(0o755 if f.is_dir() else 0o644)
    return folder


def host_folders(*folders: Path) -> dict:
    """The fields of a pod spec (an InferenceDeployment's too) that mount each of the host's `folders`
    read-only, at the same path, in each container (readable_by_pods makes them readable there)."""
    return {
        "volumes": [
            {"name": f"host-{i}", "hostPath": {"path": str(f), "type": "Directory"}}
            for i, f in enumerate(folders)
        ],
        "volumeMounts": [
            {"name": f"host-{i}", "mountPath": str(f), "readOnly": True} for i, f in enumerate(folders)
        ],
    }


def manifest(api_version: str, kind: str, name: str, spec: dict) -> dict:
    """An object to create or apply: metadata is just its name (the namespace comes from the call)."""
    return {"apiVersion": api_version, "kind": kind, "metadata": {"name": name}, "spec": spec}


@dataclass
class Cluster:
    cp: ControlPlane
    kubeconfig: Path
    api: client.ApiClient
    nodes: tuple[KubeletNode, ...]

    def node(self, name: str) -> KubeletNode:
        """The KubeletNode called `name` (its containerd and crictl)."""
        for node in self.nodes:
            if node.name == name:
                return node
        raise LookupError(f"no kubelet node {name!r} in this cluster: {[n.name for n in self.nodes]}")

    def inspect(self, pod: dict, container: int = 0) -> dict:
        """`crictl inspect` of the pod's container (by its index in the pod's status), on its node."""
        container_id = pod["status"]["containerStatuses"][container]["containerID"].split("://", 1)[1]
        node = self.node(pod["spec"]["nodeName"])
        return json.loads(node.crictl("inspect", container_id).stdout)

    def netns_path(self, pod: dict) -> str:
        """The path of `pod`'s network namespace as its runtime names it (for `nsenter --net=`)."""
        spec = self.inspect(pod)["info"]["runtimeSpec"]
        return next(ns["path"] for ns in spec["linux"]["namespaces"] if ns["type"] == "network")

    @property
    def core(self) -> client.CoreV1Api:
        return client.CoreV1Api(self.api)

    @property
    def apps(self) -> client.AppsV1Api:
        return client.AppsV1Api(self.api)

    def kubectl(
        self,
        *args: str,
        input: str | None = None,
        check: bool = True,
        token: str | None = None,
    ):
        """kubectl ARGS, the process bounded past any `--timeout=` in ARGS (a `wait`'s, a `delete`'s), so
        that kubectl says what it waited for rather than being killed first."""
        argv = [KUBECTL, f"--kubeconfig={self.kubeconfig}", *args]
        if token:
            argv.insert(2, f"--token={token}")
        r = subprocess.run(argv, input=input, capture_output=True, text=True, timeout=_kubectl_bound_s(args))
        if check and r.returncode != 0:
            raise AssertionError(f"kubectl {' '.join(args)} failed ({r.returncode}): {r.stderr}")
        return r

    def kubectl_json(self, *args: str) -> dict:
        return json.loads(self.kubectl(*args, "-o", "json").stdout)


def _kubectl_bound_s(args: tuple[str, ...], default_s: float = 120) -> float:
    """How long a kubectl of `args` may run: 30 s past the `--timeout=` it is given (s or m), else
    `default_s`."""
    for a in args:
        m = re.fullmatch(r"--timeout=(\d+)([sm])", a)
        if m:
            return int(m[1]) * (60 if m[2] == "m" else 1) + 30
    return default_s


_NO_KUBELET_NODE = cannot_run_here()
needs_kubelet_node = pytest.mark.skipif(_NO_KUBELET_NODE is not None, reason=_NO_KUBELET_NODE or "")


@contextlib.contextmanager
def kubelet_cluster(
    workdir: Path,
    images: tuple[str, ...],
    nodes: int = 1,
    small_node: tuple[str, ...] | None = None,
    **control_plane: Any,
) -> Iterator[Cluster]:
    """A control plane (ControlPlane's fields in `control_plane`) with kube-scheduler and `nodes` nodes run by the
    real kubelet, containerd and runc, with kube-proxy (devcluster.kubeletnode), each with `images` imported,
    and a tainted node of `small_node`'s images alone (kubelet_nodes); torn down after, the host put back."""
    grace = NODE_MONITOR_GRACE_S
    with ControlPlane(
        workdir=workdir / "cp", scheduler=True, node_monitor_grace_s=grace, **control_plane
    ) as cp:
        with kubelet_nodes(cp, workdir / "nodes", nodes, images=images, small_node=small_node) as started:
            api = config.new_client_from_config(config_file=str(cp.kubeconfig))
            yield Cluster(cp, cp.kubeconfig, api, tuple(started))


@pytest.fixture(scope="session")
def project_image() -> str:
    """The project's image by its content-hash tag (hack/image/build.sh: minutes when its inputs changed, else
    it only hashes them), for clusters of kubelet nodes: where those cannot run, every test on one is skipped,
    saying why."""
    if _NO_KUBELET_NODE:
        pytest.skip(_NO_KUBELET_NODE)
    r = subprocess.run(["bash", str(IMAGE_BUILD)], stdout=subprocess.PIPE, text=True, timeout=3600)
    assert r.returncode == 0, "hack/image/build.sh failed (its log is above)"
    return r.stdout.strip().splitlines()[-1]


@pytest.fixture(scope="session")
def base_image(project_image: str) -> str:
    """The image the project's was built on (Debian's python3 and nothing else): its OCI base-name label."""
    label = "org.opencontainers.image.base.name"
    fmt = '{{index .OCIv1.Config.Labels "' + label + '"}}'
    argv = ["buildah", "inspect", "--type", "image", "--format", fmt, project_image]
    r = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.strip(), f"{project_image} has no {label}: {r.stderr}"
    return r.stdout.strip()


@pytest.fixture(scope="session")
def cluster(
    project_image: str, base_image: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Cluster]:
    """The tests' dev cluster: node-1 runs the project's image, node-2 is a small node (its base alone: a
    second store of the project's image would be another 10 GB of disk), tainted, for the tests that need two
    nodes (support.operator.standin_spec(on_base=...))."""
    workdir = tmp_path_factory.mktemp("devcluster")
    images = (project_image, base_image)  # the base shares its layer with the project's image
    with kubelet_cluster(workdir, images, small_node=(base_image,)) as c:
        yield c


@pytest.fixture
def namespace(cluster: Cluster, request: pytest.FixtureRequest) -> Iterator[str]:
    """A fresh namespace per test (deleted afterwards, without waiting)."""
    name = "t-" + request.node.name.replace("_", "-").lower()[:50].strip("-")
    cluster.kubectl("create", "namespace", name)
    # The serviceaccount controller must have made "default" before pods can be created.
    wait_for(
        lambda: cluster.kubectl("get", "serviceaccount", "default", "-n", name, check=False).returncode == 0,
        30,
        f"serviceaccount default in {name}",
    )
    yield name
    cluster.kubectl("delete", "namespace", name, "--wait=false", check=False)
