"""Conditions per the Kubernetes API conventions: type, status, reason, message, lastTransitionTime,
observedGeneration. lastTransitionTime moves only when the status changes."""

from __future__ import annotations

import datetime as dt
from collections.abc import Sequence
from typing import Literal, TypedDict

ConditionStatus = Literal["True", "False", "Unknown"]


class Condition(TypedDict):
    """One entry of a status's conditions (every CRD of ours: status.conditions[])."""

    type: str
    status: ConditionStatus
    reason: str
    message: str
    observedGeneration: int
    lastTransitionTime: str


def now_iso() -> str:
    return dt.datetime.now(dt.UTC).replace(microsecond=0).isoformat().replace("+00:00", "Z")


def parse_time(s: str | None) -> float | None:
    """A status timestamp (RFC 3339, as now_iso writes it) as a Unix time; None when unset."""
    if not s:
        return None
    return dt.datetime.fromisoformat(s.replace("Z", "+00:00")).timestamp()


def set_condition(
    conditions: Sequence[Condition] | None,
    type_: str,
    status: bool | ConditionStatus,
    reason: str,
    message: str,
    generation: int,
    now: str | None = None,
) -> list[Condition]:
    """A new list with condition `type_` set; others are kept as they are."""
    status_s: ConditionStatus = status if isinstance(status, str) else ("True" if status else "False")
    out = [c.copy() for c in conditions or []]
    old = next((c for c in out if c.get("type") == type_), None)
    if old is not None and old.get("status") == status_s and old.get("lastTransitionTime"):
        since = old["lastTransitionTime"]
    else:
        since = now or now_iso()
    cond: Condition = {
        "type": type_,
        "status": status_s,
        "reason": reason,
        "message": message,
        "observedGeneration": generation,
        "lastTransitionTime": since,
    }
    if old is None:
        out.append(cond)
    else:
        out[out.index(old)] = cond
    return out


def get_condition(conditions: Sequence[Condition] | None, type_: str) -> Condition | None:
    return next((c for c in conditions or [] if c.get("type") == type_), None)


def fleet_conditions(
    old: Sequence[Condition] | None,
    desired: int,
    ready: int,
    updated: int,
    generation: int,
    workload_seen: bool,
    stalled: bool = False,
    router_problem: tuple[str, str] | None = None,
) -> list[Condition]:
    """Ready / Available / Progressing / Degraded of an InferenceDeployment from its workload's counts.

    Available: some pod serves (or none is wanted). Ready: every wanted pod is ready and runs the current
    spec, and the router (when the fleet has one) has no `router_problem` (reason, message): Ready is what
    `kubectl wait --for=condition=Ready` waits for before clients use status.endpoint."""
    conds = list(old or [])
    if not workload_seen:
        for type_, status, msg in (
            ("Ready", False, "the workload is being created"),
            ("Available", False, "the workload is being created"),
            ("Progressing", True, "creating the workload"),
            ("Degraded", False, "nothing runs yet"),
        ):
            conds = set_condition(conds, type_, status, "WorkloadMissing", msg, generation)
        return conds
    available = ready > 0 or desired == 0
    conds = set_condition(
        conds,
        "Available",
        available,
        "MinimumReplicasAvailable" if available else "MinimumReplicasUnavailable",
        f"{ready}/{desired} replicas ready",
        generation,
    )
    progressing = updated < desired or ready < desired
    conds = set_condition(
        conds,
        "Progressing",
        progressing,
        "RollingOut" if progressing else "RolloutComplete",
        f"{updated}/{desired} replicas updated, {ready} ready",
        generation,
    )
    # Degraded: fewer ready than wanted and the workload controller has given up making progress
    # (Deployment Progressing=False, ProgressDeadlineExceeded); pods that are merely loading are Progressing.
    degraded = ready < desired and stalled
    conds = set_condition(
        conds,
        "Degraded",
        degraded,
        "ProgressDeadlineExceeded" if degraded else "AsExpected",
        f"only {ready}/{desired} replicas ready and the rollout stalled"
        if degraded
        else f"{ready} replicas ready",
        generation,
    )
    all_ready = not progressing
    # A fleet of no pods has a router that cannot be ready (its /health needs a ready pod): Ready as before.
    if all_ready and router_problem is not None and desired > 0:
        reason, message = router_problem
        return set_condition(
            conds, "Ready", False, reason, f"{ready}/{desired} replicas ready; {message}", generation
        )
    return set_condition(
        conds,
        "Ready",
        all_ready,
        "AllReplicasReady" if all_ready else "ReplicasNotReady",
        f"{ready}/{desired} replicas ready and updated"
        if all_ready
        else f"{ready}/{desired} ready, {updated} updated",
        generation,
    )
