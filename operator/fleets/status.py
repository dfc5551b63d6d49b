"""InferenceDeployment status: its shape under the CRD's camelCase names (crds/inferencedeployments.yaml,
status), for the writers (the fleet's reconcile, a PrefixCacheReset's lastReset, a WeightUpdate's weight
fields) and for the one place it is read back (`fleet_status`).

Every status write is a JSON merge patch of some of these fields: a field left out is kept as it is, and a
field (or a weightVersions key) set to None is removed."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Required, TypedDict, cast

from kvpilot.operator.kube.conditions import Condition


class RouterStatus(TypedDict, total=False):
    """status.router: the fleet router's Deployment (router.py). While it stops, only its pod counts."""

    replicas: Required[int]
    readyReplicas: Required[int]
    # not in the CRD's schema, so the API server prunes it: status.router never reads back with it
    updatedReplicas: int
    service: str


class RoleStatus(TypedDict):
    """status.disaggregation.prefill and .decode: one role's workload (spec.disaggregation)."""

    replicas: int
    readyReplicas: int
    updatedReplicas: int


class LastReset(TypedDict):
    """status.lastReset: the latest PrefixCacheReset of the fleet to end."""

    name: str
    time: str
    result: str  # its final phase: Succeeded or Failed


class FleetWeights(TypedDict, total=False):
    """status.weights: the weights a WeightUpdate committed, which the catch-up brings every pod back to
    (weights/catchup.py); `model` is the spec.model they were committed over."""

    version: str
    modelPath: str
    digest: str
    model: str


class FleetStatus(TypedDict, total=False):
    """An InferenceDeployment's status, or a merge patch of some of its fields (None removes a field)."""

    replicas: int
    readyReplicas: int
    updatedReplicas: int
    selector: str
    observedGeneration: int | None
    workload: str
    endpoint: str
    router: RouterStatus | None
    disaggregation: dict[str, RoleStatus] | None  # by role; None removes it (the fleet is colocated again)
    inferencePool: str | None
    networkPolicy: str | None
    conditions: list[Condition]
    resetTokens: list[str]
    lastReset: LastReset
    weightVersion: str
    weightVersions: dict[str, int | None]  # pods per version; None removes a version no pod serves now
    weights: FleetWeights | None


def fleet_status(obj: Mapping[str, Any]) -> FleetStatus:
    """The status of an InferenceDeployment as read (from the API or a kopf body), a copy; {} when it has none.
    Not checked field by field: the API server validated every write against the CRD's schema, which
    types each field (any of them may be absent)."""
    return cast(FleetStatus, dict(obj.get("status") or {}))
