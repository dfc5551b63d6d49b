"""The chart's RBAC holds and is least privilege, proven with the API server's audit log: in each mode
(cluster-wide, and operator.watchNamespaces) the real operator runs under exactly the rendered ServiceAccount,
ClusterRoles, Roles and bindings (a token of that ServiceAccount, the Deployment's own flags) through every
feature that needs a right: a fleet with its real router, whose RoleBinding from an older operator (to a Role)
is replaced, a generated token, a targetRef reset and one that expires, a WeightUpdate that expires, a warm-up
from a ConfigMap that expires, the annotation trigger, placement
DaemonSet and back, the router turned off. Then none of the operator's or the router's requests was Forbidden, and every
(verb, resource) granted to them was requested at least once.

A dev cluster of its own (audit policy and OwnerReferencesPermissionEnforcement are kube-apiserver flags, and
no other operator may act on its fleets); its audit policy logs service accounts' requests only, at Metadata
level."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from chart.tools import CHART, Helm
from kvpilot.operator.fleets.builders import MANAGED_BY, RESET_ANNOTATION
from support.cluster import Cluster, kubelet_cluster, manifest
from support.operator import (
    OperatorProcess,
    apply,
    apply_ns,
    create_namespace,
    fleet,
    infd,
    install_crds,
    pcr,
    ready_replicas,
    service_account_kubeconfig,
    standin_spec,
    wait_phase,
)
from support.procs import wait_for

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(900)]

AUDIT_POLICY = {
    "apiVersion": "audit.k8s.io/v1",
    "kind": "Policy",
    "omitStages": ["RequestReceived"],
    "rules": [{"level": "Metadata", "userGroups": ["system:serviceaccounts"]}, {"level": "None"}],
}
RBAC_KINDS = {"ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding"}
# Flags of the rendered Deployment that only place the process in its pod: OperatorProcess sets its own.
POD_FLAGS = ("--bind=", "--liveness-port=", "--metrics-port=", "--log-level=")
# Granted for code that makes no request of its own to prove it, each checked another way (see `implied`).
IMPLIED = {
    ("update", "kvpilot.io", "inferencedeployments/finalizers"),
    ("bind", "rbac.authorization.k8s.io", "clusterroles"),
}
# Rights no request of the exercise uses yet (a right that becomes unused fails the test): pods patch fences
# a fleet pod that is off the fleet's weights, which the stand-ins (no weight routes) never are; it is
# requested in tests/operator/test_operator_weights.py (a pod killed mid-commit), through real daemons under
# the same rules. The InferencePool rights need GAIE's CRD, which this exercise does not install: they are
# requested in tests/operator/test_operator_inferencepool.py, under the same rules (rbac.cluster_role()).
AWAITING: dict[str, set[tuple[str, str, str]]] = {
    # pods/status patch: a gating warm-up's readiness gate, requested in tests/operator/test_operator_warmup.py
    "operator": {("patch", "", "pods"), ("patch", "", "pods/status")}
    | {
        (verb, "inference.networking.k8s.io", "inferencepools")
        for verb in ("get", "create", "patch", "delete")
    },
    "router": set(),
}


@dataclass(frozen=True)
class Grant:
    verb: str
    group: str
    resource: str  # with its subresource: inferencedeployments/status
    namespace: str | None  # None: everywhere (a ClusterRoleBinding)
    names: tuple[str, ...] = ()  # resourceNames; () is any

    @property
    def key(self) -> tuple[str, str, str]:
        return self.verb, self.group, self.resource

    def covers(self, req: Request) -> bool:
        return (
            (self.verb, self.group, self.resource) == (req.verb, req.group, req.resource)
            and (self.namespace is None or self.namespace == req.namespace)
            and (not self.names or req.name in self.names)
        )


@dataclass(frozen=True)
class Request:
    verb: str
    group: str
    resource: str
    namespace: str | None
    name: str | None
    code: int


def grants(rules: list[dict], namespace: str | None) -> list[Grant]:
    return [
        Grant(v, g, r, namespace, tuple(rule.get("resourceNames") or ()))
        for rule in rules
        for g in rule["apiGroups"]
        for r in rule["resources"]
        for v in rule["verbs"]
    ]


def requests(cluster: Cluster, user: str) -> list[Request]:
    """The user's resource requests in the audit log. An apply that created its object (201) needed `create`
    as well as `patch`: it counts as both."""
    out = []
    for ev in cluster.cp.audit_events():
        ref = ev.get("objectRef")
        if ev["user"]["username"] != user or ref is None:
            continue
        resource = ref["resource"] + (f"/{ref['subresource']}" if ref.get("subresource") else "")
        code = (ev.get("responseStatus") or {}).get("code", 0)
        verbs = [ev["verb"], "create"] if ev["verb"] == "patch" and code == 201 else [ev["verb"]]
        for verb in verbs:
            out.append(
                Request(verb, ref.get("apiGroup", ""), resource, ref.get("namespace"), ref.get("name"), code)
            )
    return out


def forbidden(cluster: Cluster, users: list[str]) -> list[str]:
    return [
        f"{ev['user']['username']} {ev['verb']} {ev['requestURI']}"
        for ev in cluster.cp.audit_events()
        if ev["user"]["username"] in users and (ev.get("responseStatus") or {}).get("code") == 403
    ]


def unused(granted: list[Grant], made: list[Request]) -> set[tuple[str, str, str]]:
    """Grants no authorized request needed (a 404 or 409 was authorized first; a 403 was not)."""
    return {g.key for g in granted if not any(g.covers(r) for r in made if r.code != 403)}


@pytest.fixture(scope="module")
def audited(project_image: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """A cluster of its own (a node of the real kubelet) whose API server writes an audit log."""
    with kubelet_cluster(
        tmp_path_factory.mktemp("audited"),
        (project_image,),
        audit_policy=AUDIT_POLICY,
        apiserver_args=("--enable-admission-plugins=OwnerReferencesPermissionEnforcement",),
    ) as cluster:
        install_crds(cluster)
        yield cluster


def render(helm: Helm, release: str, ns: str, *values: str) -> list[dict]:
    out = helm("template", release, str(CHART), "--namespace", ns, "--skip-tests", *values).stdout
    return [d for d in yaml.safe_load_all(out) if d]


def operator_args(objs: list[dict]) -> list[str]:
    (dep,) = [o for o in objs if o["kind"] == "Deployment"]
    args = dep["spec"]["template"]["spec"]["containers"][0]["args"]
    after = args[args.index("operator") + 1 :]
    return [a for a in after if not a.startswith(POD_FLAGS)]


def subject_rules(objs: list[dict], kind: str, name: str, ns: str) -> list[Grant]:
    """What the rendered bindings grant ServiceAccount ns/name."""
    roles = {(o["kind"], o["metadata"].get("namespace"), o["metadata"]["name"]): o for o in objs}
    out = []
    for b in objs:
        if b["kind"] not in ("ClusterRoleBinding", "RoleBinding"):
            continue
        if not any(s == {"kind": kind, "name": name, "namespace": ns} for s in b["subjects"]):
            continue
        where = b["metadata"].get("namespace")
        ref = b["roleRef"]
        role = roles[(ref["kind"], None if ref["kind"] == "ClusterRole" else where, ref["name"])]
        out += grants(role["rules"], where)
    return out


def annotate(cluster: Cluster, ns: str, name: str, value: str) -> None:
    cluster.kubectl("annotate", "infd", name, "-n", ns, f"{RESET_ANNOTATION}={value}", "--overwrite")


def patch(cluster: Cluster, ns: str, name: str, spec: str) -> None:
    cluster.kubectl("patch", "infd", name, "-n", ns, "--type=merge", "-p", f'{{"spec":{spec}}}')


def gone(cluster: Cluster, ns: str, kind: str, name: str) -> bool:
    return cluster.kubectl("get", kind, name, "-n", ns, check=False).returncode != 0


def exercise(cluster: Cluster, ns: str) -> None:
    """Every feature that needs one of the operator's rights, and a router that runs."""
    real_router = [{"name": "KVPILOT_REAL_ROUTER", "value": "1"}]
    apply_ns(cluster, ns, fleet("f", {"replicas": 1, **standin_spec(real_router)}))
    wait_for(lambda: ready_replicas(cluster, ns, "f", 1), 120, "a ready stand-in daemon")
    # A RoleBinding an older operator made for the router (to a Role of its own): roleRef cannot change, so
    # the operator replaces it (get, delete, then create through apply).
    uid = infd(cluster, ns, "f")["metadata"]["uid"]
    owner = {"apiVersion": "kvpilot.io/v1alpha1", "kind": "InferenceDeployment", "name": "f", "uid": uid}
    old = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "RoleBinding",
        "metadata": {
            "name": "f-router",
            "namespace": ns,
            "labels": dict(MANAGED_BY),
            "ownerReferences": [{**owner, "controller": True}],
        },
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "f-router"},
        "subjects": [{"kind": "ServiceAccount", "name": "f-router", "namespace": ns}],
    }
    apply(cluster, old)
    patch(cluster, ns, "f", '{"router":{"enabled":true}}')

    def bound() -> bool:
        rb = cluster.kubectl("get", "rolebinding", "f-router", "-n", ns, "-o", "json", check=False)
        return rb.returncode == 0 and yaml.safe_load(rb.stdout)["roleRef"]["kind"] == "ClusterRole"

    wait_for(bound, 90, "the router's RoleBinding to the routers' ClusterRole")
    # A reset of the fleet (its generated token, its ReplicaSets, its pods), and one that expires right after
    # (no wait for its phase: on a loaded machine it may be gone before the first look).
    apply_ns(cluster, ns, pcr("r", {"targetRef": {"name": "f"}}))
    assert wait_phase(cluster, ns, "r")["status"]["phase"] == "Succeeded"
    apply_ns(cluster, ns, pcr("expires", {"targetRef": {"name": "f"}, "ttlSecondsAfterFinished": 0}))
    wait_for(lambda: gone(cluster, ns, "pcr", "expires"), 90, "the finished reset to expire")
    # A WeightUpdate that expires right after it ends (the stand-in has no weight routes: it ends Failed after
    # its pod was called with the fleet's token, and the fleet's weightVersion is written).
    wu = {"targetRef": {"name": "f"}, "modelPath": "/ckpt", "version": "v2", "ttlSecondsAfterFinished": 0}
    apply_ns(cluster, ns, manifest("kvpilot.io/v1alpha1", "WeightUpdate", "wu", wu))
    wait_for(lambda: gone(cluster, ns, "wu", "wu"), 90, "the finished WeightUpdate to expire")
    # A warm-up from a ConfigMap that expires right after it ends (the stand-in serves no completions: it
    # ends Failed after its pod was called), so its prompts' ConfigMap is read and its TTL deletes it.
    prompts = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": "prompts"},
        "data": {"p": "[{prompt: hi}]"},
    }
    apply_ns(cluster, ns, prompts)
    warm = {
        "targetRef": {"name": "f"},
        "promptsFrom": {"configMapKeyRef": {"name": "prompts", "key": "p"}},
        "ttlSecondsAfterFinished": 0,
    }
    apply_ns(cluster, ns, manifest("kvpilot.io/v1alpha1", "PrefixCacheWarmup", "warm", warm))
    wait_for(lambda: gone(cluster, ns, "pcw", "warm"), 90, "the finished warm-up to expire")
    annotate(cluster, ns, "f", "t1")
    wait_for(lambda: "t1" in (infd(cluster, ns, "f").get("status") or {}).get("resetTokens", []), 60, "token")
    # The router runs: its EndpointSlice watch and its check that each endpoint is a pod of the fleet.
    router_user = f"system:serviceaccount:{ns}:f-router"

    def router_did(*keys: tuple[str, str]) -> bool:
        return set(keys) <= {(r.verb, r.resource) for r in requests(cluster, router_user)}

    wait_for(lambda: router_did(("watch", "endpointslices"), ("list", "pods")), 180, "the router's watch")
    # Placement DaemonSet and back: each workload kind applied, read and deleted (and read by the router).
    patch(cluster, ns, "f", '{"placement":"DaemonSet"}')
    wait_for(lambda: gone(cluster, ns, "deployment", "f"), 90, "the Deployment to go for the DaemonSet")
    wait_for(lambda: router_did(("get", "daemonsets")), 90, "the router to check the DaemonSet's pods")
    patch(cluster, ns, "f", '{"placement":"Deployment"}')
    wait_for(lambda: gone(cluster, ns, "daemonset", "f"), 90, "the DaemonSet to go for the Deployment")
    # The router goes with spec.router.
    patch(cluster, ns, "f", '{"router":{"enabled":false}}')
    for kind in ("deployment", "service", "serviceaccount", "rolebinding"):
        wait_for(lambda kind=kind: gone(cluster, ns, kind, "f-router"), 90, f"{kind} f-router to go")
    # The fleet's NetworkPolicy (on by default) goes with spec.networkPolicy.enabled: read, then deleted.
    patch(cluster, ns, "f", '{"networkPolicy":{"enabled":false}}')
    wait_for(lambda: gone(cluster, ns, "networkpolicy", "f"), 90, "the NetworkPolicy f to go")


@pytest.mark.parametrize("mode", ["cluster-wide", "namespaced"])
def test_every_rendered_right_is_used_and_none_is_missing(
    audited: Cluster, helm: Helm, tmp_path: Path, mode: str
) -> None:
    cluster = audited
    short = "cw" if mode == "cluster-wide" else "ns"
    release, release_ns, fleet_ns = short, f"{short}-system", f"{short}-fleets"
    values = ["--set", f"operator.watchNamespaces={{{fleet_ns}}}"] if mode == "namespaced" else []
    objs = render(helm, release, release_ns, *values)
    operator_sa = f"{release}-kvpilot-operator"
    # What the chart grants, and to whom: the operator's bindings, and the routers' ClusterRole, which the
    # operator binds in a fleet's namespace; no other object of the chart carries rights.
    assert {o["kind"] for o in objs} - RBAC_KINDS == {"Deployment", "Service"}
    for ns in (release_ns, fleet_ns):
        create_namespace(cluster, ns)
    apply(cluster, [o for o in objs if o["kind"] in RBAC_KINDS])
    operator_grants = subject_rules(objs, "ServiceAccount", operator_sa, release_ns)
    (router_role,) = [o for o in objs if o["metadata"]["name"] == f"{release}-kvpilot-router"]
    router_grants = grants(router_role["rules"], fleet_ns)
    if mode == "namespaced":  # nothing namespaced outside the watched namespace
        assert all(
            g.namespace == fleet_ns
            for g in operator_grants
            if g.resource not in ("customresourcedefinitions", "namespaces")
        )

    kubeconfig = service_account_kubeconfig(cluster, release_ns, operator_sa, tmp_path / "kubeconfig")
    op = OperatorProcess(kubeconfig, tmp_path / "operator.log")
    op.start(*operator_args(objs))
    try:
        exercise(cluster, fleet_ns)
    finally:
        op.stop()
    op_user = f"system:serviceaccount:{release_ns}:{operator_sa}"
    router_user = f"system:serviceaccount:{fleet_ns}:f-router"
    refused = forbidden(cluster, [op_user, router_user])
    assert not refused, f"{sorted(set(refused))}\noperator log: {op.log}"

    made = requests(cluster, op_user)
    # The implied rights: `bind` let the operator create the router's RoleBinding though it holds none of
    # the router's rights (else the API server's escalation check would have refused it), and every owned
    # object was created with blockOwnerDeletion under OwnerReferencesPermissionEnforcement.
    router_keys = {(g.verb, g.group, g.resource) for g in router_grants}
    assert not router_keys <= {g.key for g in operator_grants}
    assert any(r.resource == "rolebindings" and r.verb == "create" and r.code == 201 for r in made)
    assert any(r.resource == "deployments" and r.verb == "create" and r.code == 201 for r in made)
    assert unused(operator_grants, made) == IMPLIED | AWAITING["operator"]
    assert unused(router_grants, requests(cluster, router_user)) == AWAITING["router"]
    cluster.kubectl("delete", "namespace", fleet_ns, "--wait=false")
