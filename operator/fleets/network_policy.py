"""The NetworkPolicy of an InferenceDeployment's daemons (`spec.networkPolicy`, on by default): a pure function
of its spec and of where the operator runs.

Ingress to the daemon pods is allowed only:
- on the HTTP port (OpenAI API, /health, /metrics, the admin reset): from the fleet's router pods, from the
  operator's pods (which reset them and read /prefix_cache), and from every namespace listed in
  `allowFromNamespaces` (clients of a fleet without a router, Prometheus);
- on the KV event ports (each rank's events and replay, when the router routes prefix-aware): from the
  fleet's router pods only;
- on the KV-transfer port (spec.disaggregation): from the fleet's decode pods only. The rule is on every pod
  of the fleet, but only prefill pods listen there, so it opens the prefill pods' port to the decode pods.
Egress is not restricted. The policy only holds where a network plugin enforces NetworkPolicies.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvpilot.operator.fleets.builders import (
    KV_TRANSFER_PORT,
    MANAGED_BY,
    kv_events_ports_by_rank,
    pod_labels,
    role_labels,
    router_spec,
    selector_labels,
)
from kvpilot.operator.fleets.router_objects import router_selector
from kvpilot.operator.specs import FleetSpec

NAMESPACE_NAME = "kubernetes.io/metadata.name"  # set by the API server on every namespace
# The labels the chart gives the operator's pod (charts/kvpilot templates/_helpers.tpl operatorSelector, less
# the release name, which the chart adds through --operator-pod-labels).
DEFAULT_OPERATOR_LABELS = {"app.kubernetes.io/name": "kvpilot", "app.kubernetes.io/component": "operator"}


@dataclass(frozen=True, slots=True)
class OperatorPeer:
    """Where the operator's pods are, for the daemons' ingress rule. `namespace` None: not known (an operator
    run outside the cluster), so no rule names it."""

    namespace: str | None = None
    labels: dict[str, str] = field(default_factory=lambda: dict(DEFAULT_OPERATOR_LABELS))


def enabled(spec: FleetSpec) -> bool:
    return spec.network_policy.enabled


def policy_name(name: str) -> str:
    return name


def _router_peer(name: str) -> dict[str, Any]:
    # No namespaceSelector: pods of the policy's own namespace, where the router runs.
    return {"podSelector": {"matchLabels": router_selector(name)}}


def network_policy(name: str, spec: FleetSpec, operator: OperatorPeer) -> dict[str, Any]:
    port = spec.port
    http_from: list[dict[str, Any]] = []
    if router_spec(spec):
        http_from.append(_router_peer(name))
    if operator.namespace:
        http_from.append(
            {
                "namespaceSelector": {"matchLabels": {NAMESPACE_NAME: operator.namespace}},
                "podSelector": {"matchLabels": dict(operator.labels)},
            }
        )
    for ns in spec.network_policy.allow_from_namespaces or []:
        http_from.append({"namespaceSelector": {"matchLabels": {NAMESPACE_NAME: ns}}})
    # An empty `from` would mean "from anywhere": with no peer at all the rule is left out (nobody may).
    ingress: list[dict[str, Any]] = []
    if http_from:
        ingress.append({"from": http_from, "ports": [{"protocol": "TCP", "port": port}]})
    events = kv_events_ports_by_rank(spec)
    if events:
        ports = [{"protocol": "TCP", "port": p} for pair in events for p in pair]
        ingress.append({"from": [_router_peer(name)], "ports": ports})
    if spec.disaggregation:
        decode = {"podSelector": {"matchLabels": role_labels(name, "decode")}}
        ingress.append({"from": [decode], "ports": [{"protocol": "TCP", "port": KV_TRANSFER_PORT}]})
    labels = {k: v for k, v in pod_labels(name).items() if k != "app.kubernetes.io/component"}
    spec_: dict[str, Any] = {
        "podSelector": {"matchLabels": selector_labels(name)},
        "policyTypes": ["Ingress"],
    }
    if ingress:
        # Left out when empty (Ingress with no rule: nobody may): the API server stores [] as absent, and an
        # apply of [] would then change the object every time, an endless apply-watch loop.
        spec_["ingress"] = ingress
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {"name": policy_name(name), "labels": {**labels, **MANAGED_BY}},
        "spec": spec_,
    }
