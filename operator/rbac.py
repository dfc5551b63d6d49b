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
    # Owner references with blockOwnerDeletion (kopf.adopt) need this under OwnerReferencesPermissionEnforcement.
    {"apiGroups": ["kvpilot.io"], "resources": ["inferencedeployments/finalizers"], "verbs": ["update"]},
    # Also create (annotation trigger) and delete (ttlSecondsAfterFinished) resets.
    {
        "apiGroups": ["kvpilot.io"],
        "resources": ["prefixcacheresets"],
        "verbs": ["get", "list", "watch", "patch", "create", "delete"],
    },
    {
        "apiGroups": ["kvpilot.io"],
        "resources": ["inferencedeployments/status", "prefixcacheresets/status"],
        "verbs": ["patch"],
    },
    # Owned workloads: watched (edits and readiness arrive as events), server-side applied (patch, and create:
    # an apply that creates the object needs both), read and deleted when placement changes. kopf watches
    # cluster-wide (label-selected by the API server, but RBAC cannot be narrowed by label); with `-n` the same
    # rules can go into namespaced Roles.
    {
        "apiGroups": ["apps"],
        "resources": ["deployments", "daemonsets"],
        "verbs": ["get", "list", "watch", "create", "patch", "delete"],
    },
    # Which ReplicaSets belong to a fleet's Deployment: its token goes only to the pods they run.
    {"apiGroups": ["apps"], "resources": ["replicasets"], "verbs": ["list"]},
    # get and delete: a fleet's router Service goes when spec.router is disabled (read first: only if ours).
    {
        "apiGroups": [""],
        "resources": ["services"],
        "verbs": ["get", "list", "watch", "create", "patch", "delete"],
    },
    # The fleet router's identity: a ServiceAccount, and a Role (bound to it) that reads the fleet's
    # EndpointSlices. Applied, read and deleted like the router's Deployment, and watched (label-selected by
    # the API server) so that an edit or a deletion is put back.
    {
        "apiGroups": [""],
        "resources": ["serviceaccounts"],
        "verbs": ["get", "list", "watch", "create", "patch", "delete"],
    },
    {
        "apiGroups": ["rbac.authorization.k8s.io"],
        "resources": ["roles", "rolebindings"],
        "verbs": ["get", "list", "watch", "create", "patch", "delete"],
    },
    # Never used by the operator itself: Kubernetes lets it grant only what it holds (RBAC escalation
    # prevention), and the router's Role grants exactly this.
    {"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"], "verbs": ["get", "list", "watch"]},
    # Reset targets: listed by label selector at start, then watched so a token never goes to a stale IP.
    {"apiGroups": [""], "resources": ["pods"], "verbs": ["list", "watch"]},
    # Admin tokens, read by name only (no list/watch: no other Secret is ever seen); create: a fleet's
    # generated token and its KV event keys (both made once, never patched).
    {"apiGroups": [""], "resources": ["secrets"], "verbs": ["get", "create"]},
    # A fleet's NetworkPolicy (spec.networkPolicy): applied, watched (label-selected) so that an edit or a
    # deletion is put back, read and deleted when switched off (only if ours).
    {
        "apiGroups": ["networking.k8s.io"],
        "resources": ["networkpolicies"],
        "verbs": ["get", "list", "watch", "create", "patch", "delete"],
    },
    # Events on start, per failed pod, at the end, and on rollouts.
    {"apiGroups": [""], "resources": ["events"], "verbs": ["create"]},
    # kopf: discovers resources through CRDs, and its peering (two replicas never both act); the operator
    # creates its peering object when it is missing.
    {
        "apiGroups": ["apiextensions.k8s.io"],
        "resources": ["customresourcedefinitions"],
        "verbs": ["list", "watch"],
    },
    {"apiGroups": [""], "resources": ["namespaces"], "verbs": ["list", "watch"]},
    {
        "apiGroups": ["kopf.dev"],
        "resources": ["clusterkopfpeerings", "kopfpeerings"],
        "verbs": ["get", "list", "watch", "patch", "create"],
    },
]


def cluster_role(name: str = CLUSTER_ROLE_NAME) -> dict[str, Any]:
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "ClusterRole",
        "metadata": {"name": name, "labels": {"app.kubernetes.io/name": "kvpilot-operator"}},
        "rules": [dict(r) for r in RULES],
    }


def cluster_role_binding(
    sa_namespace: str, sa_name: str = "kvpilot-operator", role: str = CLUSTER_ROLE_NAME
) -> dict[str, Any]:
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "ClusterRoleBinding",
        "metadata": {"name": role},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": role},
        "subjects": [{"kind": "ServiceAccount", "name": sa_name, "namespace": sa_namespace}],
    }
