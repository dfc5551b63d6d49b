"""Desired manifests of an InferenceDeployment's fleet router (`spec.router`): pure functions of its spec.

The router (`kvpilot router --fleet NAME`) finds the daemons through the fleet Service's EndpointSlices, so it
gets a ServiceAccount of its own and a RoleBinding, in the fleet's namespace, to the routers' ClusterRole that
the chart ships (kvpilot.operator.rbac.ROUTER_RULES): the operator makes no Role, so it needs no rights on
Roles and none of the router's own (it holds `bind` on that one ClusterRole). Its pods carry their own selector label, never the fleet's: the fleet Service and
PrefixCacheResets must not pick up router pods as daemons.
"""

from __future__ import annotations

import copy
from typing import Any

from kvpilot.operator.fleets.builders import (
    KV_KEYS_DIR,
    MANAGED_BY,
    ROUTER_KEY_FILES,
    copied,
    fleet_env,
    kv_keys_mount,
    kvpilot_container,
    router_spec,
)
from kvpilot.operator.rbac import RBAC_GROUP, ROUTER_CLUSTER_ROLE
from kvpilot.operator.specs import FleetSpec, RouterSpec

ROUTER_LABEL = "kvpilot.io/router"  # value: the InferenceDeployment's name
ROUTER_PORT = 8080
ROUTER_CONTAINER = "router"
PICKER_PORT_NAME = (
    "grpc-epp"  # the endpoint picker's port (spec.router.endpointPicker), container and Service
)
KINDS = ("Deployment", "Service", "RoleBinding", "ServiceAccount")  # deletion order when disabled


def router_name(name: str) -> str:
    return f"{name}-router"


def router_selector(name: str) -> dict[str, str]:
    return {ROUTER_LABEL: name}


def router_labels(name: str) -> dict[str, str]:
    return {
        **router_selector(name),
        "app.kubernetes.io/name": "kvpilot",
        "app.kubernetes.io/instance": name,
        "app.kubernetes.io/component": "router",
        **MANAGED_BY,
    }


def endpoint(name: str, namespace: str, spec: FleetSpec) -> str:
    """The URL clients use for this fleet: the router's Service when there is one, else the fleet's."""
    if router_spec(spec):
        return f"http://{router_name(name)}.{namespace}.svc:{ROUTER_PORT}"
    return f"http://{name}.{namespace}.svc:{spec.port}"


def service_account(name: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "ServiceAccount",
        "metadata": {"name": router_name(name), "labels": router_labels(name)},
    }


def role_binding(name: str, namespace: str, router_role: str = ROUTER_CLUSTER_ROLE) -> dict[str, Any]:
    """The router's ServiceAccount gets the routers' ClusterRole in this namespace only."""
    return {
        "apiVersion": f"{RBAC_GROUP}/v1",
        "kind": "RoleBinding",
        "metadata": {"name": router_name(name), "labels": router_labels(name)},
        "roleRef": {"apiGroup": RBAC_GROUP, "kind": "ClusterRole", "name": router_role},
        "subjects": [{"kind": "ServiceAccount", "name": router_name(name), "namespace": namespace}],
    }


def _container(name: str, spec: FleetSpec, r: RouterSpec) -> dict[str, Any]:
    args = [
        "router",
        "--fleet",
        name,
        "--namespace",
        "$(POD_NAMESPACE)",
        "--policy",
        r.policy,
        "--host",
        "$(POD_IP)",
        "--port",
        str(ROUTER_PORT),
    ]
    if spec.model:
        args += ["--model", spec.model]  # the router tokenizes with the daemons' tokenizer
    ports = [{"name": "http", "containerPort": ROUTER_PORT, "protocol": "TCP"}]
    if r.endpoint_picker.enabled:
        args += ["--endpoint-picker-port", str(r.endpoint_picker.port)]
        ports.append({"name": PICKER_PORT_NAME, "containerPort": r.endpoint_picker.port, "protocol": "TCP"})
    keys = kv_keys_mount(name, spec, ROUTER_KEY_FILES)
    if keys:
        args += ["--kv-events-curve-dir", KV_KEYS_DIR]  # the daemons let in only this key pair
    # The fleet's own token: required on the router's /reset_prefix_cache and sent to the fleet's pods; the
    # user's env says where the model (the router's tokenizer) is cached, as for the daemons.
    env = fleet_env(name, spec, {"POD_IP": "status.podIP", "POD_NAMESPACE": "metadata.namespace"})
    c = kvpilot_container(
        ROUTER_CONTAINER,
        spec,
        args,
        env,
        ports,
        # Alive is "listening": a fleet scaled to zero must not get its router restarted in a loop.
        {
            "tcpSocket": {"port": "http"},
            "initialDelaySeconds": 60,
            "periodSeconds": 10,
            "timeoutSeconds": 5,
            "failureThreshold": 6,
        },
    )
    c.update(copied(r, ("resources",)) | copied(spec, ("volume_mounts", "security_context")))
    if keys:
        c["volumeMounts"] = [*c.get("volumeMounts", []), keys[1]]
    return c


def deployment(name: str, spec: FleetSpec) -> dict[str, Any]:
    r = router_spec(spec)
    assert r is not None
    pod_spec: dict[str, Any] = {
        "serviceAccountName": router_name(name),
        "automountServiceAccountToken": True,  # it watches EndpointSlices
        "enableServiceLinks": False,
        # After SIGTERM the router stops listening and lets open streams run to their end (as the daemons do).
        "terminationGracePeriodSeconds": 35,
        "containers": [_container(name, spec, r)],
    }
    # The fleet's volumes hold its model, whose tokenizer the router loads; they may exist only on the fleet's
    # nodes (hostPath, local volumes), so the router goes where the daemons may go: their nodeSelector,
    # tolerations and node affinity. Not their pod (anti-)affinity, which is about the daemons' own labels.
    pod_spec.update(copied(spec, ("volumes", "image_pull_secrets", "node_selector", "tolerations")))
    if keys := kv_keys_mount(name, spec, ROUTER_KEY_FILES):
        pod_spec["volumes"] = [*pod_spec.get("volumes", []), keys[0]]
    node_affinity = (spec.affinity or {}).get("nodeAffinity")
    if node_affinity:
        pod_spec["affinity"] = {"nodeAffinity": copy.deepcopy(node_affinity)}
    if spec.pod_security_context:
        pod_spec["securityContext"] = copy.deepcopy(spec.pod_security_context)
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": router_name(name), "labels": router_labels(name)},
        "spec": {
            "replicas": r.replicas,
            "selector": {"matchLabels": router_selector(name)},
            "template": {
                "metadata": {
                    "labels": router_labels(name),
                    "annotations": {
                        "prometheus.io/scrape": "true",
                        "prometheus.io/port": str(ROUTER_PORT),
                        "prometheus.io/path": "/metrics",
                    },
                },
                "spec": pod_spec,
            },
        },
    }


def service(name: str, spec: FleetSpec) -> dict[str, Any]:
    ports = [{"name": "http", "port": ROUTER_PORT, "targetPort": "http", "protocol": "TCP"}]
    r = router_spec(spec)
    if r and r.endpoint_picker.enabled:
        # h2c: gateways that read appProtocol (Envoy Gateway, Istio) then speak gRPC's HTTP/2 to the picker.
        ports.append(
            {
                "name": PICKER_PORT_NAME,
                "port": r.endpoint_picker.port,
                "targetPort": PICKER_PORT_NAME,
                "protocol": "TCP",
                "appProtocol": "kubernetes.io/h2c",
            }
        )
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": router_name(name), "labels": router_labels(name)},
        "spec": {
            "type": "ClusterIP",
            "selector": router_selector(name),
            "ports": ports,
        },
    }


def objects(
    name: str, namespace: str, spec: FleetSpec, router_role: str = ROUTER_CLUSTER_ROLE
) -> list[dict[str, Any]]:
    """Everything the router needs, in creation order (its identity before the pods that use it)."""
    return [
        service_account(name),
        role_binding(name, namespace, router_role),
        deployment(name, spec),
        service(name, spec),
    ]
