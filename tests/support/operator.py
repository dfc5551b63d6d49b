"""The operator's cluster tests' parts: our CRDs on the dev cluster (support.cluster), the operator's
ServiceAccount bound to exactly the (cluster-wide) rules of kvpilot.operator.rbac, the operator as a subprocess, and
builders and probes of fleets and resets.

Pods run the project's image (built from this checkout) on a node of the real kubelet (support.cluster), so
`kvpilot serve` is this checkout's daemon. Fleets whose daemon is not the point mount tests/operator/ from the
host (a read-only hostPath, at the same path) and put its shim/ first on PATH, where `kvpilot` is a stand-in.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import sysconfig
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from devcluster.kubeletnode import SMALL_NODE_TAINT
from kvpilot.operator import rbac
from kvpilot.operator.specs import FleetSpec
from support import ROOT
from support.cluster import Cluster, host_folders, manifest
from support.procs import free_port, spawn, stop, wait_for

# The image a fleet runs unless its spec names another: the project's, as the dev cluster's nodes name it too.
PROJECT_IMAGE = FleetSpec.model_fields["image"].default
STANDIN_DIR = ROOT / "tests" / "operator"
# A pod env's PATH replaces the image's (Containerfile's ENV): the stand-in's `python3` is still the image's venv.
IMAGE_PATH = "/opt/kvpilot/venv/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
STANDIN_ENV = [{"name": "PATH", "value": f"{STANDIN_DIR / 'shim'}:{IMAGE_PATH}"}]
STANDIN_VOLUME = {"name": "standin", "hostPath": {"path": str(STANDIN_DIR), "type": "Directory"}}
STANDIN_MOUNT = {"name": "standin", "mountPath": str(STANDIN_DIR), "readOnly": True}
OP_NS = "kvpilot-system"


def standin_spec(env: list | None = None, on_base: str = "") -> dict:
    """The fields of an InferenceDeployment's spec that make its daemons stand-ins (`env` added to their env).
    `on_base`: the project image's base (support.cluster.base_image), Debian's python3 alone, which the dev
    cluster's small node holds: there aiohttp comes from this venv's site-packages, mounted (its compiled parts
    for CPython 3.11, which the base has: the project's python), and the pods tolerate that node's taint."""
    spec = {"env": [*STANDIN_ENV, *(env or [])], "volumes": [STANDIN_VOLUME], "volumeMounts": [STANDIN_MOUNT]}
    if not on_base:
        return spec
    site = Path(sysconfig.get_path("purelib"))
    mounted = host_folders(site)
    spec["env"][0] = {"name": "PATH", "value": f"{STANDIN_DIR / 'shim'}:/usr/local/bin:/usr/bin:/bin"}
    spec["env"].append({"name": "PYTHONPATH", "value": str(site)})
    return {
        **spec,
        "image": on_base,
        "imagePullPolicy": "Never",
        "tolerations": [{**SMALL_NODE_TAINT, "operator": "Equal"}],
        "volumes": [*spec["volumes"], *mounted["volumes"]],
        "volumeMounts": [*spec["volumeMounts"], *mounted["volumeMounts"]],
    }


class OperatorProcess:
    """`python -m kvpilot.operator.main` under the RBAC-limited ServiceAccount's kubeconfig."""

    def __init__(self, kubeconfig: Path, log: Path) -> None:
        self.kubeconfig, self.log = kubeconfig, log
        self.proc: subprocess.Popen | None = None
        self.metrics_port = self.liveness_port = 0

    def start(self, *extra: str) -> None:
        self.metrics_port, self.liveness_port = free_port(), free_port()
        env = {**os.environ, "KUBECONFIG": str(self.kubeconfig)}
        argv = [
            sys.executable,
            "-m",
            "kvpilot.operator.main",
            "--bind",
            "127.0.0.1",
            "--metrics-port",
            str(self.metrics_port),
            "--liveness-port",
            str(self.liveness_port),
            *extra,
        ]
        self.proc = spawn(argv, log_path=self.log, env=env)
        wait_for(self.healthy, 60, "the operator's /healthz")

    def healthy(self) -> bool:
        if self.proc is None or self.proc.poll() is not None:
            raise RuntimeError(f"operator exited: {self.log.read_text()[-3000:]}")
        with urllib.request.urlopen(f"http://127.0.0.1:{self.liveness_port}/healthz", timeout=2) as r:
            return r.status == 200

    def metrics(self) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5) as r:
            return r.read().decode()

    def metric(self, name: str, **labels: str) -> float:
        total = 0.0
        for line in self.metrics().splitlines():
            if not line.startswith(name + "{") and not line.startswith(name + " "):
                continue
            if all(f'{k}="{v}"' in line for k, v in labels.items()):
                total += float(line.rsplit(" ", 1)[1])
        return total

    def kill(self) -> None:
        """SIGKILL: no cleanup, as a crash or an OOM kill would leave it."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is not None:
            stop(self.proc, grace=15)

    def restart(self, *extra: str) -> None:
        self.stop()
        self.start(*extra)


def apply(cluster: Cluster, objs: object) -> None:
    docs = objs if isinstance(objs, list) else [objs]
    cluster.kubectl("apply", "-f", "-", input="\n---\n".join(yaml.safe_dump(d) for d in docs))


PROMPT = "Prefix cache probe for the fleet. " + "The quick brown fox jumps over the lazy dog. " * 6


def http(method: str, url: str, body: dict | None = None, timeout: float = 120) -> dict:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read() or b"null")


def cached_tokens(ip: str, cache_salt: str | None = None, model: str | None = None) -> int:
    """The pod's cached tokens of PROMPT (under `cache_salt`, or the LoRA adapter `model` names)."""
    body: dict = {"prompt": PROMPT, "max_tokens": 1, "temperature": 0}
    body |= {"cache_salt": cache_salt} if cache_salt else {}
    body |= {"model": model} if model else {}
    r = http("POST", f"http://{ip}:8000/v1/completions", body)
    return r["usage"]["prompt_tokens_details"]["cached_tokens"]


def fleet_pods(cluster: Cluster, ns: str, name: str) -> list[dict]:
    items = cluster.kubectl_json("get", "pods", "-n", ns, "-l", f"kvpilot.io/inference-deployment={name}")[
        "items"
    ]
    return [p for p in items if not p["metadata"].get("deletionTimestamp")]


def service_endpoints(cluster: Cluster, ns: str, service: str) -> dict[str, bool]:
    """The pods in the Service's EndpointSlices (what the fleet router and kube-proxy read), each with its
    endpoint's ready condition."""
    slices = cluster.kubectl_json(
        "get", "endpointslices", "-n", ns, "-l", f"kubernetes.io/service-name={service}"
    )
    return {
        ep["targetRef"]["name"]: bool((ep.get("conditions") or {}).get("ready"))
        for s in slices["items"]
        for ep in s.get("endpoints") or []
    }


def container_pid(cluster: Cluster, ns: str, pod: str) -> int:
    """The host pid of the pod's first container's process (its pid 1: a signal to it from the host's pid
    namespace is delivered, SIGKILL ends the container, SIGSTOP freezes the daemon), as its runtime says."""
    return int(cluster.inspect(cluster.kubectl_json("get", "pod", pod, "-n", ns))["info"]["pid"])


def infd(cluster: Cluster, ns: str, name: str) -> dict:
    return cluster.kubectl_json("get", "infd", name, "-n", ns)


def ready_replicas(cluster: Cluster, ns: str, name: str, n: int) -> bool:
    st = infd(cluster, ns, name).get("status") or {}
    return st.get("readyReplicas") == n and st.get("replicas") == n


def pcr(name: str, spec: dict) -> dict:
    return manifest("kvpilot.io/v1alpha1", "PrefixCacheReset", name, spec)


def fleet(name: str, spec: dict) -> dict:
    return manifest("kvpilot.io/v1alpha1", "InferenceDeployment", name, spec)


def apply_ns(cluster: Cluster, ns: str, obj: dict) -> None:
    obj = {**obj, "metadata": {**obj["metadata"], "namespace": ns}}
    apply(cluster, obj)


def standin_fleet(cluster: Cluster, ns: str, name: str, replicas: int = 2, env: list | None = None) -> None:
    """An InferenceDeployment of `replicas` stand-in daemons in `ns` (`env` added to their pod env), waited for
    until all are ready."""
    apply_ns(cluster, ns, fleet(name, {"replicas": replicas, **standin_spec(env)}))
    wait_for(lambda: ready_replicas(cluster, ns, name, replicas), 90, f"{replicas} ready stand-in daemons")


def standin_deployment(name: str, replicas: int, labels: dict, env: list | None = None) -> dict:
    """A plain Deployment of stand-in daemons (a fleet the operator does not manage: reached by selector)."""
    container = {
        "name": "d",
        "image": PROJECT_IMAGE,
        "imagePullPolicy": "Never",  # no registry serves it
        "command": ["kvpilot", "serve"],
        "args": ["--host", "$(POD_IP)", "--port", "8000"],
        "env": [
            {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
            *STANDIN_ENV,
            *(env or []),
        ],
        # named as a fleet pod's port is: the fleet Service's targetPort (its endpoints list the pod then)
        "volumeMounts": [STANDIN_MOUNT],
        "ports": [{"name": "http", "containerPort": 8000}],
        "readinessProbe": {"httpGet": {"path": "/health", "port": 8000}, "periodSeconds": 1},
    }
    pod = {"terminationGracePeriodSeconds": 1, "containers": [container], "volumes": [STANDIN_VOLUME]}
    return manifest(
        "apps/v1",
        "Deployment",
        name,
        {
            "replicas": replicas,
            "selector": {"matchLabels": {"app": name}},
            "template": {"metadata": {"labels": {"app": name, **labels}}, "spec": pod},
        },
    )


def standin_pod(name: str, labels: dict, env: list | None = None, owner: dict | None = None) -> dict:
    """A bare listening stand-in pod (not run by any fleet) that counts the calls it receives."""
    dep = standin_deployment(name, 1, labels, env)
    meta = {"name": name, "labels": dep["spec"]["template"]["metadata"]["labels"]}
    if owner:
        meta["ownerReferences"] = [owner]
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": dep["spec"]["template"]["spec"]}


@pytest.fixture(scope="session")
def operator_kubeconfig(cluster: Cluster, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """CRDs installed; a kubeconfig for ServiceAccount kvpilot-system/kvpilot-operator, bound to rbac.cluster_role()
    only, and the routers' ClusterRole it binds.
    The peering object is not made here: the operator makes it (as for a user who follows the README)."""
    install_crds(cluster)
    create_namespace(cluster, OP_NS)
    apply(
        cluster,
        [
            {
                "apiVersion": "v1",
                "kind": "ServiceAccount",
                "metadata": {"name": "kvpilot-operator", "namespace": OP_NS},
            },
            rbac.cluster_role(),
            rbac.cluster_role_binding(OP_NS),
            rbac.router_cluster_role(),  # what the operator binds for each fleet router
        ],
    )
    return service_account_kubeconfig(
        cluster, OP_NS, "kvpilot-operator", tmp_path_factory.mktemp("operator") / "kubeconfig"
    )


def install_crds(cluster: Cluster) -> None:
    """crds/ applied (kvpilot's and kopf's peering CRDs) and established."""
    cluster.kubectl("apply", "-f", str(ROOT / "crds"))
    for crd in (
        "inferencedeployments.kvpilot.io",
        "prefixcacheresets.kvpilot.io",
        "prefixcachewarmups.kvpilot.io",
        "weightupdates.kvpilot.io",
        "clusterkopfpeerings.kopf.dev",
        "kopfpeerings.kopf.dev",
    ):
        cluster.kubectl("wait", "--for=condition=Established", f"crd/{crd}", "--timeout=60s")


def create_namespace(cluster: Cluster, ns: str) -> None:
    """The namespace (if missing), once its default ServiceAccount exists (pods need it)."""
    cluster.kubectl("create", "namespace", ns, check=False)
    wait_for(
        lambda: cluster.kubectl("get", "sa", "default", "-n", ns, check=False).returncode == 0,
        30,
        f"sa in {ns}",
    )


def service_account_kubeconfig(cluster: Cluster, ns: str, name: str, path: Path) -> Path:
    """A kubeconfig with a token of ServiceAccount ns/name: its requests get exactly that account's rights."""
    token = cluster.kubectl("create", "token", name, "-n", ns, "--duration=6h").stdout.strip()
    path.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "current-context": "op",
                "clusters": [
                    {
                        "name": "dev",
                        "cluster": {
                            "server": cluster.cp.url,
                            "certificate-authority": str(cluster.cp.ca_cert),
                        },
                    }
                ],
                "users": [{"name": "op", "user": {"token": token}}],
                "contexts": [{"name": "op", "context": {"cluster": "dev", "user": "op"}}],
            }
        )
    )
    return path


@pytest.fixture(scope="session")
def operator(
    operator_kubeconfig: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[OperatorProcess]:
    op = OperatorProcess(operator_kubeconfig, tmp_path_factory.mktemp("operator-log") / "operator.log")
    op.start()
    yield op
    op.stop()
    print(f"operator log: {op.log}")


def reset_status(cluster: Cluster, ns: str, name: str) -> dict:
    """A PrefixCacheReset's status ({} before the operator's first write)."""
    return cluster.kubectl_json("get", "pcr", name, "-n", ns).get("status") or {}


@pytest.fixture
def ns(namespace: str, operator: OperatorProcess) -> str:
    """The test's own namespace (support.cluster's `namespace`), with the operator running."""
    return namespace


def wait_phase(cluster: Cluster, ns: str, name: str, timeout: float = 90) -> dict:
    def done() -> dict | None:
        obj = cluster.kubectl_json("get", "pcr", name, "-n", ns)
        return obj if (obj.get("status") or {}).get("phase") in ("Succeeded", "Failed") else None

    return wait_for(done, timeout, f"PrefixCacheReset {ns}/{name} to finish")  # type: ignore[return-value]


def pods_by_name(pcr: dict) -> dict[str, dict]:
    return {p["name"]: p for p in pcr["status"]["pods"]}
