"""The operator's RBAC rules and the fleet routers' ClusterRole: the one source of truth (the chart renders
them through hack/chart/sync.py; the tests run the operator with exactly these). Each rule names only the
verbs the code uses, and why; tests/chart/test_chart_rbac.py runs the operator under the rendered chart's
RBAC with the API server's audit log on and fails on a granted verb nobody requested, or a Forbidden.

Two modes, as the chart has them:
- cluster-wide (no `operator.watchNamespaces`): everything in one ClusterRole. This is the broad mode: it may
  read any Secret of the cluster whose name it is given and write Deployments, Services, ServiceAccounts and
  RoleBindings in every namespace.
- namespaced (`operator.watchNamespaces`): the namespaced rules go into a Role in each watched namespace;
  the ClusterRole keeps only what is cluster-scoped (CRD discovery, the namespaces kopf follows).

The fleet routers get no Role made by the operator: the chart ships one ClusterRole for them
(`router_cluster_role`) and the operator only makes a RoleBinding to it in the fleet's namespace. Creating a
binding is allowed when one holds every permission it grants or `bind` on that role; the operator holds
`bind` on exactly that one ClusterRole (resourceNames), so it needs neither the router's read rights itself
nor any verb on Roles, and it can never bind anything else (no RBAC escalation rights).
"""

from __future__ import annotations

import copy
from typing import Any

CLUSTER_ROLE_NAME = "kvpilot-operator"
# The fleet routers' ClusterRole when `kvpilot operator --router-cluster-role` is not given (an operator run by
# hand makes it). The chart ships and names its own, "<release>-router"; this name never ends in "-router", so
# no release's role is ever taken (`helm install` refuses to adopt an object it did not make).
ROUTER_CLUSTER_ROLE = "kvpilot-router-default"
RBAC_GROUP = "rbac.authorization.k8s.io"

Rule = dict[str, Any]

# What a fleet router reads in its own namespace (granted by a RoleBinding there, never cluster-wide).
ROUTER_RULES: list[Rule] = [
    # Its fleet Service's EndpointSlices: listed, then watched (router/fleet/discovery.py).
    {"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"], "verbs": ["list", "watch"]},
    # Whether an endpoint is a Pod its fleet controls before prompts and the fleet's token go there
    # (router/fleet/discovery.py FleetMembers, kvpilot/kube/fleet_members.py): the InferenceDeployment and its workload
    # (a DaemonSet fleet's on a Deployment's 404), the workload's ReplicaSets and the fleet's pods, listed by
    # the fleet's label. A ClusterRole shared by every fleet cannot name them (resourceNames): any of the
    # namespace's, read only.
    {"apiGroups": ["kvpilot.io"], "resources": ["inferencedeployments"], "verbs": ["get"]},
    {"apiGroups": ["apps"], "resources": ["deployments", "daemonsets"], "verbs": ["get"]},
    {"apiGroups": ["apps"], "resources": ["replicasets"], "verbs": ["list"]},
    {"apiGroups": [""], "resources": ["pods"], "verbs": ["list"]},
]

# Namespaced rules, in the watched namespaces (a Role each) or cluster-wide.
_NAMESPACED: list[Rule] = [
    # Watch our resources; patch them for kopf's handler bookkeeping (annotations) and finalizers; get: an
    # owned object's event reads its owner, a reset reads its target.
    {
        "apiGroups": ["kvpilot.io"],
        "resources": ["inferencedeployments"],
        "verbs": ["get", "list", "watch", "patch"],
    },
    # Owner references with blockOwnerDeletion (kopf.adopt) need this under OwnerReferencesPermissionEnforcement
    # (an admission check, no request of its own; tests/operator/test_operator_rbac.py).
    {"apiGroups": ["kvpilot.io"], "resources": ["inferencedeployments/finalizers"], "verbs": ["update"]},
    # Also create (annotation trigger) and delete (ttlSecondsAfterFinished) resets.
    {
        "apiGroups": ["kvpilot.io"],
        "resources": ["prefixcacheresets"],
        "verbs": ["get", "list", "watch", "patch", "create", "delete"],
    },
    # WeightUpdates: watched and read (get: the daemon re-reads it before it runs), patched for kopf's
    # bookkeeping and finalizers, deleted by ttlSecondsAfterFinished. Made by people and the CLI, never by us.
    {
        "apiGroups": ["kvpilot.io"],
        "resources": ["weightupdates"],
        "verbs": ["get", "list", "watch", "patch", "delete"],
    },
    # PrefixCacheWarmups: as WeightUpdates (watched, read by their daemon, kopf's bookkeeping, TTL); made by
    # people, never by us.
    {
        "apiGroups": ["kvpilot.io"],
        "resources": ["prefixcachewarmups"],
        "verbs": ["get", "list", "watch", "patch", "delete"],
    },
    {
        "apiGroups": ["kvpilot.io"],
        "resources": [
            "inferencedeployments/status",
            "prefixcacheresets/status",
            "weightupdates/status",
            "prefixcachewarmups/status",
        ],
        "verbs": ["patch"],
    },
    # A Continuous warm-up with gateReadiness: the kvpilot.io/warm condition of the fleet's pods (their
    # readiness gate), set True once a pod is warmed, False while it is not.
    {"apiGroups": [""], "resources": ["pods/status"], "verbs": ["patch"]},
    # A warm-up's prompts from a ConfigMap (spec.promptsFrom), read by the name its spec gives: no list/watch.
    {"apiGroups": [""], "resources": ["configmaps"], "verbs": ["get"]},
    # Owned workloads (the daemons' Deployment or, with placement DaemonSet, DaemonSet; the router's
    # Deployment): watched (edits and readiness arrive as events; label-selected by the API server, but RBAC
    # cannot be narrowed by label), server-side applied (patch, and create: an apply that creates the object
    # needs both), read and deleted when placement changes or the router is turned off.
    {
        "apiGroups": ["apps"],
        "resources": ["deployments", "daemonsets"],
        "verbs": ["get", "list", "watch", "create", "patch", "delete"],
    },
    # Which ReplicaSets belong to a fleet's Deployment: its token goes only to the pods they run.
    {"apiGroups": ["apps"], "resources": ["replicasets"], "verbs": ["list"]},
    # The fleet's Service and the router's, its ServiceAccount, and the RoleBinding that gives it the
    # router ClusterRole: applied, read (only ours are ever written or deleted), watched so that an edit or a
    # deletion is put back, deleted when spec.router is turned off.
    {
        "apiGroups": [""],
        "resources": ["services", "serviceaccounts"],
        "verbs": ["get", "list", "watch", "create", "patch", "delete"],
    },
    {
        "apiGroups": [RBAC_GROUP],
        "resources": ["rolebindings"],
        "verbs": ["get", "list", "watch", "create", "patch", "delete"],
    },
    # Reset and weight update targets: listed by label selector at start, then watched so a token never goes
    # to a stale IP; patched to fence a fleet pod that is not on the fleet's weights and to let it back (its
    # kvpilot.io/serving label only, which the fleet's Service selects: operator/weights/fence.py).
    {"apiGroups": [""], "resources": ["pods"], "verbs": ["list", "watch", "patch"]},
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
    # A fleet's InferencePool (spec.router.endpointPicker, where GAIE's CRD is served): read (only ours is
    # ever written or deleted), server-side applied, deleted when the picker is turned off. Not watched: the
    # fleet's own events and the CRD's (customresourcedefinitions, below) reconcile it.
    {
        "apiGroups": ["inference.networking.k8s.io"],
        "resources": ["inferencepools"],
        "verbs": ["get", "create", "patch", "delete"],
    },
    # Events on start, per failed pod, at the end, and on rollouts.
    {"apiGroups": [""], "resources": ["events"], "verbs": ["create"]},
]

# Cluster-scoped rules of both modes. kopf discovers resources through the CRDs (list, then watch);
# `ensure_peering` lists them too, and the InferencePool CRD's events reconcile the fleets with an endpoint
# picker (handlers.pool_crd_changed).
_CLUSTER: list[Rule] = [
    {
        "apiGroups": ["apiextensions.k8s.io"],
        "resources": ["customresourcedefinitions"],
        "verbs": ["list", "watch"],
    },
]
# The peering object: kopf watches it and patches its own entry in; the operator creates it when missing and
# (cluster-wide) reads it once to warn about peers of equal priority.
_CLUSTERWIDE_PEERING: Rule = {
    "apiGroups": ["kopf.dev"],
    "resources": ["clusterkopfpeerings"],
    "verbs": ["get", "list", "watch", "patch", "create"],
}
_NAMESPACED_PEERING: Rule = {
    "apiGroups": ["kopf.dev"],
    "resources": ["kopfpeerings"],
    "verbs": ["list", "watch", "patch", "create"],
}
# kopf follows the namespaces it is told to watch only when it is not cluster-wide.
_NAMESPACES: Rule = {"apiGroups": [""], "resources": ["namespaces"], "verbs": ["list", "watch"]}


def bind_router_role(router_role: str = ROUTER_CLUSTER_ROLE) -> Rule:
    """`bind` on the router ClusterRole alone: the one way the operator hands out rights."""
    return {
        "apiGroups": [RBAC_GROUP],
        "resources": ["clusterroles"],
        "verbs": ["bind"],
        "resourceNames": [router_role],
    }


def operator_rules(
    clusterwide: bool, router_role: str = ROUTER_CLUSTER_ROLE
) -> tuple[list[Rule], list[Rule]]:
    """(the ClusterRole's rules, the rules of the Role in each watched namespace); the second is empty in
    cluster-wide mode. The bind rule is namespaced: the API server checks `bind` in the binding's namespace."""
    namespaced = [*_NAMESPACED, bind_router_role(router_role)]
    if clusterwide:
        return copy.deepcopy([*namespaced, *_CLUSTER, _CLUSTERWIDE_PEERING]), []
    return copy.deepcopy([*_CLUSTER, _NAMESPACES]), copy.deepcopy([*namespaced, _NAMESPACED_PEERING])


def _meta(name: str, component: str) -> dict[str, Any]:
    return {
        "name": name,
        "labels": {"app.kubernetes.io/name": "kvpilot", "app.kubernetes.io/component": component},
    }


def cluster_role(name: str = CLUSTER_ROLE_NAME, router_role: str = ROUTER_CLUSTER_ROLE) -> dict[str, Any]:
    """The cluster-wide operator's ClusterRole."""
    return {
        "apiVersion": f"{RBAC_GROUP}/v1",
        "kind": "ClusterRole",
        "metadata": _meta(name, "operator"),
        "rules": operator_rules(True, router_role)[0],
    }


def router_cluster_role(name: str = ROUTER_CLUSTER_ROLE) -> dict[str, Any]:
    return {
        "apiVersion": f"{RBAC_GROUP}/v1",
        "kind": "ClusterRole",
        "metadata": _meta(name, "router"),
        "rules": copy.deepcopy(ROUTER_RULES),
    }


def cluster_role_binding(
    sa_namespace: str, sa_name: str = "kvpilot-operator", role: str = CLUSTER_ROLE_NAME
) -> dict[str, Any]:
    return {
        "apiVersion": f"{RBAC_GROUP}/v1",
        "kind": "ClusterRoleBinding",
        "metadata": {"name": role},
        "roleRef": {"apiGroup": RBAC_GROUP, "kind": "ClusterRole", "name": role},
        "subjects": [{"kind": "ServiceAccount", "name": sa_name, "namespace": sa_namespace}],
    }
