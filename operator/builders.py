"""Desired manifests of an InferenceDeployment: pure functions of its spec, testable without a cluster.

The handlers adopt what these return (ownerReferences) and create or patch it; nothing here talks to the API.
"""

from __future__ import annotations

import copy
from typing import Any

GROUP = "kvpilot.io"
VERSION = "v1alpha1"
FLEET_LABEL = "kvpilot.io/inference-deployment"
MANAGED_BY = {"app.kubernetes.io/managed-by": "kvpilot-operator"}
RESET_ANNOTATION = "kvpilot.io/reset-prefix-cache"
CONTAINER = "kvpilot"

# engine field -> `kvpilot serve` flag (DESIGN section 1: flag names follow vLLM's)
_ENGINE_FLAGS = {
    "blockSize": "--block-size",
    "maxNumSeqs": "--max-num-seqs",
    "maxNumBatchedTokens": "--max-num-batched-tokens",
    "maxModelLen": "--max-model-len",
    "kvCacheBlocks": "--num-gpu-blocks-override",
    "kvCacheMemoryBytes": "--kv-cache-memory-bytes",
    "dtype": "--dtype",
    "dataParallelSize": "--data-parallel-size",
    "tensorParallelSize": "--tensor-parallel-size",
}
GPU_RESOURCE = "nvidia.com/gpu"


def selector_labels(name: str) -> dict[str, str]:
    """The labels that select a fleet's pods; never change them (a Deployment's selector is immutable)."""
    return {FLEET_LABEL: name}


def selector_string(name: str) -> str:
    return ",".join(f"{k}={v}" for k, v in selector_labels(name).items())


def pod_labels(name: str) -> dict[str, str]:
    return {
        **selector_labels(name),
        "app.kubernetes.io/name": "kvpilot",
        "app.kubernetes.io/instance": name,
        "app.kubernetes.io/component": "inference",
        **MANAGED_BY,
    }


def serve_args(spec: dict[str, Any]) -> list[str]:
    """Arguments of `kvpilot serve` for this spec. The daemon binds the pod IP (a pod's own address; on the
    dev cluster's loopback network two pods must not both bind 0.0.0.0:port)."""
    port = int(spec.get("port", 8000))
    args = ["serve", "--host", "$(POD_IP)", "--port", str(port)]
    if spec.get("model"):
        args += ["--model", str(spec["model"])]
    if spec.get("servedModelName"):
        args += ["--served-model-name", str(spec["servedModelName"])]
    engine = spec.get("engine") or {}
    for field, flag in _ENGINE_FLAGS.items():
        if engine.get(field) is not None:
            args += [flag, str(engine[field])]
    if engine.get("enablePrefixCaching") is False:
        args.append("--no-enable-prefix-caching")
    return args


def container(spec: dict[str, Any]) -> dict[str, Any]:
    port = int(spec.get("port", 8000))
    env: list[dict[str, Any]] = [
        {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
    ]
    ref = spec.get("adminTokenSecretRef")
    if ref:
        # The token comes from the Secret at pod start; it never appears in the pod spec or in args.
        env.append(
            {
                "name": "KVPILOT_ADMIN_TOKEN",
                "valueFrom": {"secretKeyRef": {"name": ref["name"], "key": ref.get("key", "token")}},
            }
        )
    env += copy.deepcopy(spec.get("env") or [])
    c: dict[str, Any] = {
        "name": CONTAINER,
        "image": spec.get("image", "ghcr.io/kvpilot/kvpilot:latest"),
        "imagePullPolicy": spec.get("imagePullPolicy", "IfNotPresent"),
        "command": ["kvpilot"],
        "args": serve_args(spec),
        "env": env,
        "ports": [{"name": "http", "containerPort": port, "protocol": "TCP"}],
        # /health is 200 only once the model is loaded and the engine loop runs: no traffic before that.
        "readinessProbe": {
            "httpGet": {"path": "/health", "port": "http"},
            "periodSeconds": 2,
            "timeoutSeconds": 2,
            "failureThreshold": 3,
        },
        # Generous: loading a model can take minutes; a liveness kill mid-load would loop forever.
        "livenessProbe": {
            "httpGet": {"path": "/health", "port": "http"},
            "initialDelaySeconds": 120,
            "periodSeconds": 10,
            "timeoutSeconds": 5,
            "failureThreshold": 6,
        },
    }
    if spec.get("resources"):
        c["resources"] = copy.deepcopy(spec["resources"])
        _gpus_per_pod(c["resources"], spec.get("engine") or {})
    return c


def _gpus_per_pod(resources: dict[str, Any], engine: dict[str, Any]) -> None:
    """A pod that asks for GPUs gets one per rank: data-parallel size x tensor-parallel size."""
    gpus = int(engine.get("dataParallelSize") or 1) * int(engine.get("tensorParallelSize") or 1)
    for kind in ("requests", "limits"):
        if GPU_RESOURCE in (resources.get(kind) or {}):
            resources[kind][GPU_RESOURCE] = gpus


def pod_template(name: str, spec: dict[str, Any]) -> dict[str, Any]:
    port = int(spec.get("port", 8000))
    pod_spec: dict[str, Any] = {
        "containers": [container(spec)],
        # The daemon drains in-flight requests on SIGTERM (its --shutdown-timeout is 30 s).
        "terminationGracePeriodSeconds": 35,
        "enableServiceLinks": False,
        "automountServiceAccountToken": False,  # the daemon never talks to the API server
    }
    if spec.get("nodeSelector"):
        pod_spec["nodeSelector"] = dict(spec["nodeSelector"])
    if spec.get("tolerations"):
        pod_spec["tolerations"] = copy.deepcopy(spec["tolerations"])
    return {
        "metadata": {
            "labels": pod_labels(name),
            "annotations": {
                "prometheus.io/scrape": "true",
                "prometheus.io/port": str(port),
                "prometheus.io/path": "/metrics",
            },
        },
        "spec": pod_spec,
    }


def workload_kind(spec: dict[str, Any]) -> str:
    return "DaemonSet" if spec.get("placement") == "DaemonSet" else "Deployment"


def workload(name: str, spec: dict[str, Any]) -> dict[str, Any]:
    """The Deployment (or DaemonSet for placement DaemonSet) that runs the daemons."""
    kind = workload_kind(spec)
    body: dict[str, Any] = {
        "apiVersion": "apps/v1",
        "kind": kind,
        "metadata": {"name": name, "labels": pod_labels(name)},
        "spec": {
            "selector": {"matchLabels": selector_labels(name)},
            "template": pod_template(name, spec),
        },
    }
    if kind == "Deployment":
        body["spec"]["replicas"] = int(spec.get("replicas", 1))
    return body


def service(name: str, spec: dict[str, Any]) -> dict[str, Any]:
    port = int(spec.get("port", 8000))
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": name, "labels": pod_labels(name)},
        "spec": {
            "type": "ClusterIP",
            "selector": selector_labels(name),
            "ports": [{"name": "http", "port": port, "targetPort": "http", "protocol": "TCP"}],
        },
    }


def drifted(desired: Any, actual: Any) -> bool:
    """True when `actual` lacks something `desired` says. Fields the API server or controllers add
    (defaults, status) are ignored, so a freshly created object never counts as drifted."""
    if isinstance(desired, dict):
        if not isinstance(actual, dict):
            return True
        return any(drifted(v, actual.get(k)) for k, v in desired.items())
    if isinstance(desired, list):
        if not isinstance(actual, list) or len(actual) != len(desired):
            return True
        return any(drifted(d, a) for d, a in zip(desired, actual))
    if isinstance(desired, (int, float)) and isinstance(actual, str):
        return str(desired) != actual
    return desired != actual


def reset_for_token(name: str, token: str, owner_spec: dict[str, Any]) -> dict[str, Any]:
    """The PrefixCacheReset that the annotation token asks for. Its name is a function of the token, so a
    second attempt (after a crash or a conflict) finds the first one instead of resetting twice."""
    import hashlib

    digest = hashlib.sha256(token.encode()).hexdigest()[:10]
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "PrefixCacheReset",
        "metadata": {
            "name": f"{name[:40]}-reset-{digest}",
            "labels": {FLEET_LABEL: name, **MANAGED_BY},
            "annotations": {RESET_ANNOTATION: token[:253]},
        },
        "spec": {"targetRef": {"name": name}},
    }
