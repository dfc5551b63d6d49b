"""WeightUpdate status: one bounded entry per pod under the CRD's camelCase names (crds/weightupdates.yaml,
status.pods), exact counts, and the InferenceDeployment's status.weightVersion from what its pods serve."""

from __future__ import annotations

import enum
import re
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

MAX_POD_DETAIL = 100  # status.pods entries at most (not Succeeded first); the counts cover every pod
MAX_RANKS = 64
MAX_MESSAGE = 200  # characters of a pod's message: a daemon's error, never a body we did not read
_SECRETS = re.compile(r"(?i)(bearer\s+|token[=:]\s*)\S+")


class WeightResult(enum.StrEnum):
    """One pod's result in a WeightUpdate (status.pods[].result)."""

    PENDING = "Pending"  # not decided yet
    STAGED = "Staged"  # holds the new weights, not serving them
    SUCCEEDED = "Succeeded"  # serving them
    DROPPED = "Dropped"  # its stage was dropped: it serves what it served before
    FAILED = "Failed"  # its stage failed: it serves what it served before
    FENCED = "Fenced"  # its commit failed: not on the fleet's version, out of its Service


@dataclass(slots=True)
class PodUpdate:
    name: str
    result: WeightResult = WeightResult.PENDING
    staged_digest: str = ""
    version: str = ""  # the version it serves, as it last said
    message: str = ""
    ranks: list[dict[str, Any]] = field(default_factory=list)


def redact(message: str) -> str:
    """A pod's message as status shows it: no token, one line, short."""
    one_line = " ".join(_SECRETS.sub(r"\1<redacted>", message).split())
    return one_line if len(one_line) <= MAX_MESSAGE else one_line[: MAX_MESSAGE - 3] + "..."


def rank_entries(body: dict[str, Any]) -> list[dict[str, Any]]:
    """A daemon reply's `ranks`, each as {rank, version, digest, stagedDigest} where it said so."""
    out = []
    for r in (body.get("ranks") or [])[:MAX_RANKS]:
        if not isinstance(r, dict) or not isinstance(r.get("rank"), int):
            continue
        entry: dict[str, Any] = {"rank": r["rank"], "success": "error" not in r}
        for key, name in (
            ("weight_version", "version"),
            ("digest", "digest"),
            ("staged_digest", "stagedDigest"),
        ):
            if isinstance(r.get(key), str) and r[key]:
                entry[name] = r[key]
        if isinstance(r.get("error"), str):
            entry["message"] = redact(r["error"])
        out.append(entry)
    return out


# status.pods lists the pods that need a look first
_SHOWN_FIRST = (
    WeightResult.FENCED,
    WeightResult.FAILED,
    WeightResult.DROPPED,
    WeightResult.PENDING,
    WeightResult.STAGED,
    WeightResult.SUCCEEDED,
)


def pod_entry(p: PodUpdate) -> dict[str, Any]:
    out: dict[str, Any] = {"name": p.name, "result": p.result}
    optional = {"stagedDigest": p.staged_digest, "version": p.version, "message": p.message, "ranks": p.ranks}
    out.update((k, v) for k, v in optional.items() if v)
    return out


def pod_status(pods: Sequence[PodUpdate]) -> dict[str, Any]:
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


def fleet_weight_version(versions: Sequence[str]) -> dict[str, Any]:
    """InferenceDeployment status fields: weightVersion (the one version, or `mixed`) and the pods per
    version (a pod that did not say counted under "unknown")."""
    counts = Counter(versions)
    one = next(iter(counts)) if len(counts) == 1 else "mixed"
    return {"weightVersion": one, "weightVersions": dict(sorted(counts.items()))}
