"""WeightUpdate status: one bounded entry per pod under the CRD's camelCase names (crds/weightupdates.yaml,
status.pods), exact counts, and the InferenceDeployment's status.weightVersion from what its pods serve; its
shape (`WeightUpdateStatus`), and the one place it is read back (`update_status`)."""

from __future__ import annotations

import enum
import re
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Required, TypedDict, cast

from kvpilot.operator.fleets.status import FleetStatus
from kvpilot.operator.kube.conditions import Condition

MAX_POD_DETAIL = 100  # status.pods entries at most (not Succeeded first); the counts cover every pod
MAX_RANKS = 64
MAX_MESSAGE = 200  # characters of a pod's message: a daemon's error, never a body we did not read
_SECRETS = re.compile(r"(?i)(bearer\s+|token[=:]\s*)\S+")

WeightPhase = Literal["Pending", "Staging", "Committing", "Succeeded", "Failed", "Degraded"]


class WeightResult(enum.StrEnum):
    """One pod's result in a WeightUpdate (status.pods[].result)."""

    PENDING = "Pending"  # not decided yet
    STAGED = "Staged"  # holds the new weights, not serving them
    SUCCEEDED = "Succeeded"  # serving them
    DROPPED = "Dropped"  # its stage was dropped: it serves what it served before
    FAILED = "Failed"  # its stage failed: it serves what it served before
    FENCED = "Fenced"  # its commit failed: not on the fleet's version, out of its Service


class WeightRankEntry(TypedDict, total=False):
    """status.pods[].ranks[]: one rank of a pod, as its daemon's reply said (nothing it did not say)."""

    rank: Required[int]
    success: Required[bool]
    version: str
    digest: str
    stagedDigest: str
    message: str


class WeightPodEntry(TypedDict, total=False):
    """status.pods[]: one pod; a field with nothing to say is left out."""

    name: Required[str]
    result: Required[WeightResult]
    stagedDigest: str
    version: str
    message: str
    ranks: list[WeightRankEntry]


class WeightUpdateStatus(TypedDict, total=False):
    """A WeightUpdate's status, or the part of it one write sets (a JSON merge patch)."""

    phase: WeightPhase
    target: str
    version: str
    startTime: str
    observedGeneration: int | None
    targets: int
    succeeded: int
    failed: int
    progress: str
    pods: list[WeightPodEntry]
    podsOmitted: int
    completionTime: str
    conditions: list[Condition]
    digest: str


def update_status(obj: Mapping[str, Any]) -> WeightUpdateStatus:
    """The status of a WeightUpdate as read from the API; {} when it has none. Not checked field by field: the
    API server validated every write against the CRD's schema, which types each field (any of them may be
    absent)."""
    return cast(WeightUpdateStatus, obj.get("status") or {})


@dataclass(slots=True)
class PodUpdate:
    name: str
    result: WeightResult = WeightResult.PENDING
    staged_digest: str = ""
    version: str = ""  # the version it serves, as it last said
    message: str = ""
    ranks: list[WeightRankEntry] = field(default_factory=list)


def redact(message: str) -> str:
    """A pod's message as status shows it: no token, one line, short."""
    one_line = " ".join(_SECRETS.sub(r"\1<redacted>", message).split())
    return one_line if len(one_line) <= MAX_MESSAGE else one_line[: MAX_MESSAGE - 3] + "..."


def rank_entries(body: dict[str, Any]) -> list[WeightRankEntry]:
    """A daemon reply's `ranks`, each as {rank, version, digest, stagedDigest} where it said so."""
    out = []
    for r in (body.get("ranks") or [])[:MAX_RANKS]:
        if not isinstance(r, dict) or not isinstance(rank := r.get("rank"), int):
            continue
        entry: WeightRankEntry = {"rank": rank, "success": "error" not in r}
        if version := _text(r, "weight_version"):
            entry["version"] = version
        if digest := _text(r, "digest"):
            entry["digest"] = digest
        if staged := _text(r, "staged_digest"):
            entry["stagedDigest"] = staged
        if isinstance(error := r.get("error"), str):
            entry["message"] = redact(error)
        out.append(entry)
    return out


def _text(reply: dict[str, Any], key: str) -> str:
    """A string a daemon's reply holds under `key`; "" when it holds none."""
    value = reply.get(key)
    return value if isinstance(value, str) else ""


# status.pods lists the pods that need a look first
_SHOWN_FIRST = (
    WeightResult.FENCED,
    WeightResult.FAILED,
    WeightResult.DROPPED,
    WeightResult.PENDING,
    WeightResult.STAGED,
    WeightResult.SUCCEEDED,
)


def pod_entry(p: PodUpdate) -> WeightPodEntry:
    out: WeightPodEntry = {"name": p.name, "result": p.result}
    if p.staged_digest:
        out["stagedDigest"] = p.staged_digest
    if p.version:
        out["version"] = p.version
    if p.message:
        out["message"] = p.message
    if p.ranks:
        out["ranks"] = p.ranks
    return out


def pod_status(pods: Sequence[PodUpdate]) -> WeightUpdateStatus:
    counts = Counter(p.result for p in pods)
    order = {r: i for i, r in enumerate(_SHOWN_FIRST)}
    shown = sorted(pods, key=lambda p: (order.get(p.result, 3), p.name))[:MAX_POD_DETAIL]
    return {
        "targets": len(pods),
        "succeeded": counts[WeightResult.SUCCEEDED],
        "failed": counts[WeightResult.FAILED] + counts[WeightResult.FENCED],
        "progress": f"{counts[WeightResult.SUCCEEDED]}/{len(pods)}",
        "pods": [pod_entry(p) for p in shown],
        "podsOmitted": len(pods) - len(shown),
    }


def fleet_weight_version(versions: Sequence[str]) -> FleetStatus:
    """InferenceDeployment status fields: weightVersion (the one version, or `mixed`) and the pods per
    version (a pod that did not say counted under "unknown")."""
    counts = Counter(versions)
    one = next(iter(counts)) if len(counts) == 1 else "mixed"
    per_version: dict[str, int | None] = dict(sorted(counts.items()))
    return {"weightVersion": one, "weightVersions": per_version}
