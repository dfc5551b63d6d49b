"""The small part of a scheduler the node agent needs when none runs.

Filters: nodeSelector, required node affinity (labels and metadata.name,
which DaemonSet pods use), taints/tolerations, and resource fit (cpu, memory,
nvidia.com/gpu and any other extended resource, pod count). Among the nodes
that fit, the one with the fewest pods wins, which spreads replicas.
"""

from __future__ import annotations

import re
from decimal import Decimal

_SUFFIX = {
    "n": Decimal("1e-9"),
    "u": Decimal("1e-6"),
    "m": Decimal("1e-3"),
    "": Decimal(1),
    **{p: Decimal(1000) ** i for i, p in enumerate("kMGTPE", 1)},
    **{p + "i": Decimal(1024) ** i for i, p in enumerate("KMGTPE", 1)},  # Ki, Mi, ...: powers of 2**10
}


def quantity(q: str | int | float) -> Decimal:
    """Parse a Kubernetes resource quantity ("100m", "2Gi", "1e3") into a number."""
    m = re.fullmatch(r"([+-]?[0-9.]+(?:[eE][+-]?[0-9]+)?)([a-zA-Z]*)", str(q).strip())
    if not m or m.group(2) not in _SUFFIX:
        raise ValueError(f"bad quantity {q!r}")
    return Decimal(m.group(1)) * _SUFFIX[m.group(2)]


def pod_requests(pod: dict) -> dict[str, Decimal]:
    """Sum of container requests (limits stand in for absent requests, as in Kubernetes)."""
    total: dict[str, Decimal] = {}
    for c in pod["spec"].get("containers") or []:
        res = c.get("resources") or {}
        merged = {**(res.get("limits") or {}), **(res.get("requests") or {})}
        for name, value in merged.items():
            total[name] = total.get(name, Decimal(0)) + quantity(value)
    return total


def _expr_ok(expr: dict, values: dict[str, str]) -> bool:
    key, op, vals = expr["key"], expr["operator"], expr.get("values") or []
    have = values.get(key)
    if op == "In":
        return have in vals
    if op == "NotIn":
        return have not in vals
    if op == "Exists":
        return key in values
    if op == "DoesNotExist":
        return key not in values
    if op in ("Gt", "Lt") and have is not None and have.lstrip("-").isdigit():
        return int(have) > int(vals[0]) if op == "Gt" else int(have) < int(vals[0])
    return False


def _affinity_ok(pod: dict, node: dict) -> bool:
    required = ((pod["spec"].get("affinity") or {}).get("nodeAffinity") or {}).get(
        "requiredDuringSchedulingIgnoredDuringExecution"
    ) or {}
    terms = required.get("nodeSelectorTerms") or []
    if not terms:
        return True
    labels = node["metadata"].get("labels") or {}
    fields = {"metadata.name": node["metadata"]["name"]}
    return any(
        all(_expr_ok(e, labels) for e in t.get("matchExpressions") or [])
        and all(_expr_ok(e, fields) for e in t.get("matchFields") or [])
        for t in terms
    )


def _tolerated(taint: dict, tolerations: list[dict]) -> bool:
    for t in tolerations:
        if t.get("effect") and t["effect"] != taint["effect"]:
            continue
        if t.get("operator") == "Exists" and (not t.get("key") or t["key"] == taint["key"]):
            return True
        if t.get("key") == taint["key"] and t.get("value", "") == taint.get("value", ""):
            return True
    return False


def fits(pod: dict, node: dict, pods_on_node: list[dict]) -> str | None:
    """None if `pod` may go to `node`, else the reason it may not."""
    labels = node["metadata"].get("labels") or {}
    for k, v in (pod["spec"].get("nodeSelector") or {}).items():
        if labels.get(k) != v:
            return "node(s) didn't match Pod's node affinity/selector"
    if not _affinity_ok(pod, node):
        return "node(s) didn't match Pod's node affinity/selector"
    tolerations = pod["spec"].get("tolerations") or []
    for taint in node["spec"].get("taints") or []:
        if taint["effect"] in ("NoSchedule", "NoExecute") and not _tolerated(taint, tolerations):
            return f"node(s) had untolerated taint {{{taint['key']}: {taint.get('value', '')}}}"
    alloc = {k: quantity(v) for k, v in ((node.get("status") or {}).get("allocatable") or {}).items()}
    if "pods" in alloc and len(pods_on_node) + 1 > alloc["pods"]:
        return "Too many pods"
    used: dict[str, Decimal] = {}
    for other in pods_on_node:
        for k, v in pod_requests(other).items():
            used[k] = used.get(k, Decimal(0)) + v
    for k, v in pod_requests(pod).items():
        if v > 0 and used.get(k, Decimal(0)) + v > alloc.get(k, Decimal(0)):
            return f"Insufficient {k}"
    return None


def choose_node(pod: dict, nodes: list[dict], pods_by_node: dict[str, list[dict]]) -> tuple[str | None, str]:
    """The node to bind to (fewest pods among those that fit), or None and why not."""
    reasons, best = [], None
    for node in nodes:
        name = node["metadata"]["name"]
        on_node = pods_by_node.get(name, [])
        why = fits(pod, node, on_node)
        if why:
            reasons.append(why)
        elif best is None or len(on_node) < len(pods_by_node.get(best, [])):
            best = name
    if best:
        return best, ""
    return None, f"0/{len(nodes)} nodes are available: " + ", ".join(sorted(set(reasons)))
