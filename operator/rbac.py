"""The operator's RBAC rules: the one source of truth (the chart renders them; tests run the operator with
exactly these). Each rule names only the verbs the code uses, and why."""

from __future__ import annotations

from typing import Any

CLUSTER_ROLE_NAME = "kvpilot-operator"

RULES: list[dict[str, Any]] = [
    # Watch our resources; patch them for kopf's handler bookkeeping (annotations) and finalizers.
    {
        "apiGroups": ["kvpilot.io"],
        "resources": ["inferencedeployments"],
        "verbs": ["get", "list", "watch", "patch"],
    },
    # Also create (annotation trigger) and delete (ttlSecondsAfterFinished) resets.
    {
        "apiGroups": ["kvpilot.io"],
        "resources": ["prefixcacheresets"],
        "verbs": ["get", "list", "watch", "patch", "create", "delete"],
    },  # fmt: skip
    {
        "apiGroups": ["kvpilot.io"],
        "resources": ["inferencedeployments/status", "prefixcacheresets/status"],
        "verbs": ["patch"],
    },  # fmt: skip
    # Owned workloads: watched (drift and readiness arrive as events), read to compare, created, patched back
    # on drift, deleted when placement changes. kopf watches cluster-wide, so list/watch see every
    # Deployment's spec; with `-n` the same rules can go into namespaced Roles.
    {
        "apiGroups": ["apps"],
        "resources": ["deployments", "daemonsets"],
        "verbs": ["get", "list", "watch", "create", "patch", "delete"],
    },
    {"apiGroups": [""], "resources": ["services"], "verbs": ["get", "list", "watch", "create", "patch"]},
    # Reset targets: list by label selector at start; get one when a call fails (deleted -> Skipped).
    {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list"]},
    # The admin token of a fleet, read by name only (no list/watch: no other Secret is ever seen).
    {"apiGroups": [""], "resources": ["secrets"], "verbs": ["get"]},
    # Events on start, per failed pod, at the end, and on drift repair.
    {"apiGroups": [""], "resources": ["events"], "verbs": ["create"]},
    {"apiGroups": ["events.k8s.io"], "resources": ["events"], "verbs": ["create"]},
    # kopf: discovers resources through CRDs, and its peering (two replicas never both act).
    {
        "apiGroups": ["apiextensions.k8s.io"],
        "resources": ["customresourcedefinitions"],
        "verbs": ["list", "watch"],
    },
    {"apiGroups": [""], "resources": ["namespaces"], "verbs": ["list", "watch"]},
    {
        "apiGroups": ["kopf.dev"],
        "resources": ["clusterkopfpeerings", "kopfpeerings"],
        "verbs": ["get", "list", "watch", "patch"],
    },  # fmt: skip
]


def cluster_role(name: str = CLUSTER_ROLE_NAME) -> dict[str, Any]:
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "ClusterRole",
        "metadata": {"name": name, "labels": {"app.kubernetes.io/name": "kvpilot-operator"}},
        "rules": [dict(r) for r in RULES],
    }


def cluster_role_binding(sa_namespace: str, sa_name: str = "kvpilot-operator",
                         role: str = CLUSTER_ROLE_NAME) -> dict[str, Any]:  # fmt: skip
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "ClusterRoleBinding",
        "metadata": {"name": role},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": role},
        "subjects": [{"kind": "ServiceAccount", "name": sa_name, "namespace": sa_namespace}],
    }
