"""Desired manifests of an InferenceDeployment: pure functions of its spec, testable without a cluster.

The handlers adopt what these return (ownerReferences) and create or patch it; nothing here talks to the API.
"""

from __future__ import annotations

import copy
import hashlib
import json
import math
from typing import Any

from pydantic import BaseModel

from kvpilot.kube.fleet_members import FLEET_LABEL, ROLE_LABEL, ROLES
from kvpilot.operator.specs import EngineSpec, FleetSpec, LoRASpec, RouterSpec, SecretKeyRef

GROUP = "kvpilot.io"
VERSION = "v1alpha1"
FLEETS = "inferencedeployments"  # plural names of our resources
RESETS = "prefixcacheresets"
WEIGHT_UPDATES = "weightupdates"
WARMUPS = "prefixcachewarmups"
MANAGED_BY = {"app.kubernetes.io/managed-by": "kvpilot-operator"}
RESET_ANNOTATION = "kvpilot.io/reset-prefix-cache"
CONTAINER = "kvpilot"
ADMIN_TOKEN_LABEL = (
    "kvpilot.io/admin-token"  # value "true": its owner lets kvpilot send its token to pods (tokens.py)
)
# On every fleet pod: "true" while it may serve. The fleet's Service selects it, so a pod the operator fences
# ("false": not on the fleet's weights, fence.py) leaves the Service's EndpointSlices and with them the fleet
# router. Never part of a workload's selector: a fenced pod stays its ReplicaSet's, and is still reached by
# the operator's fan-outs (they list pods by the fleet label alone).
SERVING_LABEL = "kvpilot.io/serving"
ANNOTATION_RESET_TTL_S = 86400  # annotation-created resets are deleted a day after they finished

# engine field -> `kvpilot serve` flag (flag names follow vLLM's, docs/server.md "Flags")
_ENGINE_FLAGS = {
    "block_size": "--block-size",
    "max_num_seqs": "--max-num-seqs",
    "max_num_batched_tokens": "--max-num-batched-tokens",
    "max_model_len": "--max-model-len",
    "kv_cache_blocks": "--num-gpu-blocks-override",
    "kv_cache_memory_bytes": "--kv-cache-memory-bytes",
    "dtype": "--dtype",
    "data_parallel_size": "--data-parallel-size",
    "tensor_parallel_size": "--tensor-parallel-size",
    "kv_offloading_size": "--kv-offloading-size",
    "kv_offloading_dir": "--kv-offloading-dir",
    "kv_offloading_dir_size": "--kv-offloading-dir-size",
}
GPU_RESOURCE = "nvidia.com/gpu"
# InferenceDeployment fields every daemon pod takes as they are (its container's: `container`)
_POD_FIELDS = (
    "service_account_name",
    "node_selector",
    "tolerations",
    "affinity",
    "volumes",
    "image_pull_secrets",
    "priority_class_name",
)
# Where each daemon publishes its KV events when the fleet has a router (the router learns them from the
# daemon's GET /kv_events, so these are not a contract with the router, only ports inside the pod). Rank r
# of a data-parallel daemon publishes on port + r: the events take 5557..5557+N-1, the replay sockets the
# N ports after them (the CRD's CEL rule keeps the HTTP port out of that range).
KV_EVENTS_PORT = 5557
# The fleet's CURVE keys for its KV event sockets (kvpilot/kv/sockets.py): one Secret per fleet, made by the
# operator; each side mounts only its own key pair and the other side's public key.
KV_KEYS_VOLUME = "kvpilot-kv-events-curve"
KV_KEYS_DIR = "/etc/kvpilot/kv-events-curve"
DAEMON_KEY_FILES = ("server.key_secret", "client.key")  # its pair; the one client it lets in
ROUTER_KEY_FILES = ("client.key_secret", "server.key")  # its pair; the daemons' public key
# With spec.disaggregation (docs/disaggregation.md): each role's `kv_role`, and the port a prefill pod serves
# its held KV on (the connector's default, vLLM's kv_port); decode pods pull, they listen on nothing more.
KV_ROLES = {"prefill": "kv_producer", "decode": "kv_consumer"}
KV_TRANSFER_PORT = 14579
KV_TRANSFER_PORT_NAME = "kv-transfer"


def selector_labels(name: str) -> dict[str, str]:
    """The labels that select a fleet's pods; never change them (a Deployment's selector is immutable)."""
    return {FLEET_LABEL: name}


def label_selector(sel: dict[str, Any]) -> str:
    """A LabelSelector (matchLabels, matchExpressions) as the string the list and watch APIs take."""
    parts = [f"{k}={v}" for k, v in sorted((sel.get("matchLabels") or {}).items())]
    for e in sel.get("matchExpressions") or []:
        op, key, vals = e["operator"], e["key"], ",".join(e.get("values") or [])
        parts.append(
            {
                "In": f"{key} in ({vals})",
                "NotIn": f"{key} notin ({vals})",
                "Exists": key,
                "DoesNotExist": f"!{key}",
            }[op]
        )
    return ",".join(parts)


def selector_string(name: str) -> str:
    return label_selector({"matchLabels": selector_labels(name)})


def roles(spec: FleetSpec) -> tuple[str | None, ...]:
    """The roles of the fleet's workloads: prefill and decode with spec.disaggregation, else one (None)."""
    return ROLES if spec.disaggregation else (None,)


def workload_name(name: str, role: str | None) -> str:
    """A role's workload (fleet_members.workload_names names them all)."""
    return f"{name}-{role}" if role else name


def role_labels(name: str, role: str | None) -> dict[str, str]:
    """The labels that select one role's pods (a colocated fleet's: all of them)."""
    return {**selector_labels(name), ROLE_LABEL: role} if role else selector_labels(name)


def role_replicas(spec: FleetSpec, role: str | None) -> int:
    d = spec.disaggregation
    if role is None or d is None:
        return spec.replicas
    return (d.prefill if role == "prefill" else d.decode).replicas


def serving_selector(name: str) -> dict[str, str]:
    """The fleet Service's selector: the fleet's pods that are not fenced."""
    return {**selector_labels(name), SERVING_LABEL: "true"}


def pod_labels(name: str) -> dict[str, str]:
    return {
        **selector_labels(name),
        "app.kubernetes.io/name": "kvpilot",
        "app.kubernetes.io/instance": name,
        "app.kubernetes.io/component": "inference",
        **MANAGED_BY,
    }


def token_secret_ref(name: str, spec: FleetSpec) -> SecretKeyRef | None:
    """The Secret key holding the fleet's admin token: its own adminTokenSecretRef, else the Secret the
    operator generates for it; None only when the spec opts out (disableAdminToken)."""
    if spec.admin_token_secret_ref:
        return spec.admin_token_secret_ref
    if spec.disable_admin_token:
        return None
    return SecretKeyRef(name=f"{name}-admin-token")


def generated_token_secret(name: str, token: str) -> dict[str, Any]:
    """The Secret the operator creates once for a fleet without adminTokenSecretRef (never updated: a new
    token would lock the running pods' token out)."""
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": f"{name}-admin-token", "labels": {**selector_labels(name), **MANAGED_BY}},
        "type": "Opaque",
        "stringData": {"token": token},
    }


def kv_keys_secret_name(name: str) -> str:
    return f"{name}-kv-events-curve"


def kv_keys_secret(name: str, files: dict[str, str]) -> dict[str, Any]:
    """The Secret with the fleet's CURVE key pairs (`files`: kv_sockets.key_files of the server and the
    client), made once and never rewritten: running pods keep the keys they started with."""
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": kv_keys_secret_name(name), "labels": {**selector_labels(name), **MANAGED_BY}},
        "type": "Opaque",
        "stringData": dict(files),
    }


def kv_keys_mount(
    name: str, spec: FleetSpec, files: tuple[str, ...]
) -> tuple[dict[str, Any], dict[str, Any]] | None:
    """(pod volume, container mount) of the fleet's KV event keys for one side (`files`), read-only; None when
    the daemons publish no KV events."""
    if kv_events_ports_by_rank(spec) is None:
        return None
    volume = {
        "name": KV_KEYS_VOLUME,
        "secret": {
            "secretName": kv_keys_secret_name(name),
            "items": [{"key": f, "path": f} for f in files],
            "defaultMode": 0o444,
        },
    }
    return volume, {"name": KV_KEYS_VOLUME, "mountPath": KV_KEYS_DIR, "readOnly": True}


def cpu_threads(spec: FleetSpec) -> int | None:
    """Whole CPUs of the container's CPU limit (rounded up), or None without a limit."""
    q = str(((spec.resources or {}).get("limits") or {}).get("cpu", "")).strip()
    if not q:
        return None
    cores = float(q[:-1]) / 1000 if q.endswith("m") else float(q)
    return max(1, math.ceil(cores))


def serve_args(spec: FleetSpec, role: str | None = None) -> list[str]:
    """Arguments of `kvpilot serve` for this spec and role. The daemon binds the pod IP (a pod's own address;
    on the dev cluster's loopback network two pods must not both bind 0.0.0.0:port)."""
    args = ["serve", "--host", "$(POD_IP)", "--port", str(spec.port)]
    if spec.model:
        args += ["--model", spec.model]
    if spec.served_model_name:
        args += ["--served-model-name", spec.served_model_name]
    engine = spec.engine
    for field, flag in _ENGINE_FLAGS.items():
        if (value := getattr(engine, field)) is not None:
            args += [flag, str(value)]
    if not engine.enable_prefix_caching:
        args.append("--no-enable-prefix-caching")
    if engine.lora is not None:
        args += lora_args(engine.lora)
    if (threads := cpu_threads(spec)) is not None:
        args += ["--cpu-threads", str(threads)]  # torch threads follow the CPU limit, not the node's cores
    return args + kv_events_args(spec) + kv_transfer_args(role)


def kv_transfer_args(role: str | None) -> list[str]:
    """`--kv-transfer-config` of a disaggregated fleet's role (none for a colocated pod). A prefill pod serves
    pulls on the pod's own IP, as it does HTTP."""
    if role is None:
        return []
    config: dict[str, Any] = {"kv_connector": "KvpilotConnector", "kv_role": KV_ROLES[role]}
    if role == "prefill":
        config["kv_connector_extra_config"] = {"host": "$(POD_IP)", "port": KV_TRANSFER_PORT}
    return ["--kv-transfer-config", json.dumps(config)]


def lora_args(lora: LoRASpec) -> list[str]:
    """`--enable-lora` and its flags; each module in the JSON form vLLM takes, so no name or path needs
    quoting."""
    args = ["--enable-lora"]
    if lora.modules:
        args += ["--lora-modules", *(json.dumps({"name": m.name, "path": m.path}) for m in lora.modules)]
    if lora.max_loras is not None:
        args += ["--max-loras", str(lora.max_loras)]
    if lora.max_lora_rank is not None:
        args += ["--max-lora-rank", str(lora.max_lora_rank)]
    return args


def router_spec(spec: FleetSpec) -> RouterSpec | None:
    """`spec.router` when the router is enabled, else None."""
    return spec.router if spec.router and spec.router.enabled else None


def data_parallel_size(spec: FleetSpec) -> int:
    return spec.engine.data_parallel_size or 1


def kv_events_ports_by_rank(spec: FleetSpec) -> list[tuple[int, int]] | None:
    """(events port, replay port) of each rank, for fleets whose router routes by KV events
    (prefix-aware); None otherwise."""
    r = router_spec(spec)
    if not r or r.policy != "prefix-aware":
        return None
    n = data_parallel_size(spec)
    return [(KV_EVENTS_PORT + rank, KV_EVENTS_PORT + n + rank) for rank in range(n)]


def kv_events_args(spec: FleetSpec) -> list[str]:
    """Daemon flags that publish KV events (rank 0's ports; the daemon adds the rank). Bound to the pod's
    own IP, like the HTTP port."""
    ports = kv_events_ports_by_rank(spec)
    if ports is None:
        return []
    return [
        "--kv-events-endpoint",
        f"tcp://$(POD_IP):{ports[0][0]}",
        "--kv-events-replay-endpoint",
        f"tcp://$(POD_IP):{ports[0][1]}",
        "--kv-events-curve-dir",
        KV_KEYS_DIR,
    ]


def kv_events_ports(spec: FleetSpec) -> list[dict[str, Any]]:
    """The container ports of every rank's KV events (rank 0's keep the names of a single-rank pod)."""
    out = []
    for rank, (pub, replay) in enumerate(kv_events_ports_by_rank(spec) or []):
        suffix = f"-{rank}" if rank else ""
        out += [
            {"name": f"kv-events{suffix}", "containerPort": pub, "protocol": "TCP"},
            {"name": f"kv-replay{suffix}", "containerPort": replay, "protocol": "TCP"},
        ]
    return out


def fleet_env(name: str, spec: FleetSpec, downward: dict[str, str]) -> list[dict[str, Any]]:
    """The env of a fleet's containers (daemons and router): the downward-API fields named (env name -> field
    path), the fleet's admin token from its Secret, then the user's spec.env (where the model is cached, ...).
    The token comes from the Secret at pod start: it never appears in the pod spec or in args."""
    env: list[dict[str, Any]] = [
        {"name": var, "valueFrom": {"fieldRef": {"fieldPath": path}}} for var, path in downward.items()
    ]
    if ref := token_secret_ref(name, spec):
        secret = {"secretKeyRef": {"name": ref.name, "key": ref.key}}
        env.append({"name": "KVPILOT_ADMIN_TOKEN", "valueFrom": secret})
    return env + copy.deepcopy(spec.env or [])


def kvpilot_container(
    name: str,
    spec: FleetSpec,
    args: list[str],
    env: list[dict[str, Any]],
    ports: list[dict[str, Any]],
    liveness: dict[str, Any],
) -> dict[str, Any]:
    """A container of the fleet's image running `kvpilot ARGS` (a daemon or the router), Ready only while its
    /health answers 200: a daemon once its model is loaded, a router once some daemon is ready."""
    return {
        "name": name,
        "image": spec.image,
        "imagePullPolicy": spec.image_pull_policy,
        "command": ["kvpilot"],
        "args": args,
        "env": env,
        "ports": ports,
        "readinessProbe": {
            "httpGet": {"path": "/health", "port": "http"},
            "periodSeconds": 2,
            "timeoutSeconds": 2,
            "failureThreshold": 3,
        },
        "livenessProbe": liveness,
    }


def container(name: str, spec: FleetSpec, role: str | None = None) -> dict[str, Any]:
    env = fleet_env(name, spec, {"POD_IP": "status.podIP", "POD_NAME": "metadata.name"})
    ports = [{"name": "http", "containerPort": spec.port, "protocol": "TCP"}, *kv_events_ports(spec)]
    if role == "prefill":
        ports.append({"name": KV_TRANSFER_PORT_NAME, "containerPort": KV_TRANSFER_PORT, "protocol": "TCP"})
    c = kvpilot_container(
        CONTAINER,
        spec,
        serve_args(spec, role),
        env,
        ports,
        # Generous: loading a model can take minutes; a liveness kill mid-load would loop forever.
        {
            "httpGet": {"path": "/health", "port": "http"},
            "initialDelaySeconds": 120,
            "periodSeconds": 10,
            "timeoutSeconds": 5,
            "failureThreshold": 6,
        },
    )
    c.update(copied(spec, ("resources", "volume_mounts", "security_context", "startup_probe")))
    if "resources" in c:
        _gpus_per_pod(c["resources"], spec.engine)
    if keys := kv_keys_mount(name, spec, DAEMON_KEY_FILES):
        c["volumeMounts"] = [*c.get("volumeMounts", []), keys[1]]
    return c


def copied(spec: BaseModel, fields: tuple[str, ...]) -> dict[str, Any]:
    """Those of `fields` that are set (not None, not empty), deep-copied, under their names in the CRD, which
    are the Kubernetes ones: what a pod or a container takes from the spec as it is."""
    values = {type(spec).model_fields[f].alias or f: getattr(spec, f) for f in fields}
    return {key: copy.deepcopy(value) for key, value in values.items() if value}


def _gpus_per_pod(resources: dict[str, Any], engine: EngineSpec) -> None:
    """A pod that asks for GPUs gets one per rank: data-parallel size x tensor-parallel size."""
    gpus = (engine.data_parallel_size or 1) * (engine.tensor_parallel_size or 1)
    for kind in ("requests", "limits"):
        if GPU_RESOURCE in (resources.get(kind) or {}):
            resources[kind][GPU_RESOURCE] = gpus


# The readiness gate a Continuous PrefixCacheWarmup with gateReadiness holds shut until it warmed the pod.
WARM_GATE = "kvpilot.io/warm"


def pod_template(name: str, spec: FleetSpec, gated: bool = False, role: str | None = None) -> dict[str, Any]:
    pod_spec: dict[str, Any] = {
        "containers": [container(name, spec, role)],
        # The daemon drains in-flight requests on SIGTERM (its --shutdown-timeout is 30 s).
        "terminationGracePeriodSeconds": 35,
        "enableServiceLinks": False,
        # The daemon never talks to the API server; a ServiceAccount the user names may be for something else
        # (e.g. a cloud identity that reads the model store), so its token is mounted then.
        "automountServiceAccountToken": bool(spec.service_account_name),
    }
    pod_spec.update(copied(spec, _POD_FIELDS))
    if spec.pod_security_context:
        pod_spec["securityContext"] = copy.deepcopy(spec.pod_security_context)
    if keys := kv_keys_mount(name, spec, DAEMON_KEY_FILES):
        pod_spec["volumes"] = [*pod_spec.get("volumes", []), keys[0]]
    if gated:  # a warm-up with gateReadiness targets the fleet: Ready only once warm
        pod_spec["readinessGates"] = [{"conditionType": WARM_GATE}]
    return {
        "metadata": {
            # a new pod serves until fenced
            "labels": {**pod_labels(name), **role_labels(name, role), SERVING_LABEL: "true"},
            "annotations": {
                "prometheus.io/scrape": "true",
                "prometheus.io/port": str(spec.port),
                "prometheus.io/path": "/metrics",
            },
        },
        "spec": pod_spec,
    }


def workload(name: str, spec: FleetSpec, gated: bool = False, role: str | None = None) -> dict[str, Any]:
    """The Deployment (or DaemonSet for placement DaemonSet) that runs the daemons of `role` (None: a
    colocated fleet's); `gated`: its pods carry the readiness gate WARM_GATE (a PrefixCacheWarmup with
    gateReadiness targets the fleet)."""
    kind = spec.placement
    labels = {**pod_labels(name), **role_labels(name, role)}
    body: dict[str, Any] = {
        "apiVersion": "apps/v1",
        "kind": kind,
        "metadata": {"name": workload_name(name, role), "labels": labels},
        "spec": {
            # one role's pods: the two Deployments of a disaggregated fleet never claim each other's
            "selector": {"matchLabels": role_labels(name, role)},
            "template": pod_template(name, spec, gated, role),
        },
    }
    if kind == "Deployment":
        body["spec"]["replicas"] = role_replicas(spec, role)
    return body


def workloads(name: str, spec: FleetSpec, gated: bool = False) -> list[dict[str, Any]]:
    """Every workload of the fleet: one per role (`roles`)."""
    return [workload(name, spec, gated, role) for role in roles(spec)]


def service(name: str, spec: FleetSpec) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": name, "labels": pod_labels(name)},
        "spec": {
            "type": "ClusterIP",
            "selector": serving_selector(name),
            "ports": [{"name": "http", "port": spec.port, "targetPort": "http", "protocol": "TCP"}],
        },
    }


def reset_for_token(name: str, token: str) -> dict[str, Any]:
    """The PrefixCacheReset that the annotation token asks for. Its name is a function of the token, so a
    second attempt (after a crash or a conflict) finds the first one instead of resetting twice."""
    digest = hashlib.sha256(token.encode()).hexdigest()[:10]
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "PrefixCacheReset",
        "metadata": {
            "name": f"{name[:40]}-reset-{digest}",
            "labels": {FLEET_LABEL: name, **MANAGED_BY},
            "annotations": {RESET_ANNOTATION: token[:253]},
        },
        "spec": {"targetRef": {"name": name}, "ttlSecondsAfterFinished": ANNOTATION_RESET_TTL_S},
    }
