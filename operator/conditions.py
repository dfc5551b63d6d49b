"""Conditions per the Kubernetes API conventions: type, status, reason, message, lastTransitionTime,
observedGeneration. lastTransitionTime moves only when the status changes."""

from __future__ import annotations

import datetime as dt
from typing import Any


def now_iso() -> str:
    return dt.datetime.now(dt.UTC).replace(microsecond=0).isoformat().replace("+00:00", "Z")


def set_condition(
    conditions: list[dict[str, Any]] | None,
    type_: str,
    status: bool | str,
    reason: str,
    message: str,
    generation: int | None = None,
    now: str | None = None,
) -> list[dict[str, Any]]:
    """A new list with condition `type_` set; others are kept as they are."""
    status_s = status if isinstance(status, str) else ("True" if status else "False")
    out = [dict(c) for c in conditions or []]
    old = next((c for c in out if c.get("type") == type_), None)
    cond = {"type": type_, "status": status_s, "reason": reason, "message": message}
    if generation is not None:
        cond["observedGeneration"] = generation
    if old is not None and old.get("status") == status_s and old.get("lastTransitionTime"):
        cond["lastTransitionTime"] = old["lastTransitionTime"]
    else:
        cond["lastTransitionTime"] = now or now_iso()
    if old is None:
        out.append(cond)
    else:
        out[out.index(old)] = cond
    return out


def get_condition(conditions: list[dict[str, Any]] | None, type_: str) -> dict[str, Any] | None:
    return next((c for c in conditions or [] if c.get("type") == type_), None)


def fleet_conditions(
    old: list[dict[str, Any]] | None,
    desired: int,
    ready: int,
    updated: int,
    generation: int,
    workload_seen: bool,
    stalled: bool = False,
) -> list[dict[str, Any]]:
    """Available / Progressing / Degraded of an InferenceDeployment from its workload's counts."""
    conds = list(old or [])
    if not workload_seen:
        conds = set_condition(
            conds, "Available", False, "WorkloadMissing", "the workload is being created", generation
        )
        conds = set_condition(conds, "Progressing", True, "Creating", "creating the workload", generation)
        return set_condition(conds, "Degraded", False, "WorkloadMissing", "nothing runs yet", generation)
    available = ready >= desired if desired > 0 else True
    conds = set_condition(
        conds, "Available", available, "MinimumReplicasAvailable" if available else "MinimumReplicasUnavailable",
        f"{ready}/{desired} replicas ready", generation,
    )  # fmt: skip
    progressing = updated < desired or ready < desired
    conds = set_condition(
        conds, "Progressing", progressing, "RollingOut" if progressing else "RolloutComplete",
        f"{updated}/{desired} replicas updated, {ready} ready", generation,
    )  # fmt: skip
    # Degraded: fewer ready than wanted and the workload controller has given up making progress
    # (Deployment Progressing=False, ProgressDeadlineExceeded); pods that are merely loading are Progressing.
    degraded = ready < desired and stalled
    return set_condition(
        conds, "Degraded", degraded, "ProgressDeadlineExceeded" if degraded else "AsExpected",
        f"only {ready}/{desired} replicas ready and the rollout stalled" if degraded else f"{ready} replicas ready",
        generation,
    )  # fmt: skip
