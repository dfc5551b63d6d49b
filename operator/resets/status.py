"""PrefixCacheReset status from the fan-out's results: exact counts and bounded per-pod entries, under the
CRD's camelCase names (crds/prefixcachereset.yaml, status.pods); its shape (`ResetStatus`), and the one place
it is read back (`reset_status`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Literal, Required, TypedDict, cast

from kvpilot.fanout import PodResult, RankResult
from kvpilot.fanout.results import STILL_WARM, Outcome, Verified
from kvpilot.operator.kube.conditions import Condition, ConditionStatus

MAX_POD_DETAIL = 100  # status.pods entries at most (not Succeeded first); counts are always exact
MAX_RANKS = (
    64  # status.pods[].ranks entries at most (the CRD's maxItems): a node has a few dozen accelerators
)

ResetPhase = Literal["Pending", "Running", "Succeeded", "Failed"]
CountKey = Literal["succeeded", "failed", "skipped", "notSupported", "pending"]


class RankEntry(TypedDict, total=False):
    """status.pods[].ranks[]: one data-parallel rank's part of a pod's reset reply."""

    rank: Required[int]
    success: Required[bool]
    epoch: int
    evictedBlocks: int


class PodEntry(TypedDict, total=False):
    """status.pods[]: one pod's result; a field with nothing to say is left out."""

    name: Required[str]
    result: Required[Outcome]
    attempts: Required[int]
    node: str
    ip: str
    role: str  # prefill or decode, in a disaggregated fleet
    httpStatus: int
    epoch: int
    evictedBlocks: int
    message: str
    durationSeconds: float
    ranks: list[RankEntry]
    reason: str
    cleared: list[str]
    verified: Verified
    verification: str


class ResetCounts(TypedDict):
    """The status counts: targets and how many ended in each result (pending: not final yet)."""

    targets: int
    succeeded: int
    failed: int
    skipped: int
    notSupported: int
    pending: int


class ResetStatus(TypedDict, total=False):
    """A PrefixCacheReset's status, or the part of it one write sets (a JSON merge patch)."""

    phase: ResetPhase
    target: str
    startTime: str
    completionTime: str
    observedGeneration: int | None
    conditions: list[Condition]
    targets: int
    succeeded: int
    failed: int
    skipped: int
    notSupported: int
    pending: int
    progress: str
    verified: str  # "cold/said success", or "off"
    verifiedCold: int
    verifiedWarm: int
    verifiedUnknown: int
    pods: list[PodEntry]
    podsOmitted: int


def reset_status(obj: Mapping[str, Any]) -> ResetStatus:
    """The status of a PrefixCacheReset as read from the API; {} when it has none. Not checked field by
    field: the API server validated every write against the CRD's schema, which types each field (any of
    them may be absent)."""
    return cast(ResetStatus, obj.get("status") or {})


_COUNT_KEY: dict[Outcome, CountKey] = {
    Outcome.SUCCEEDED: "succeeded",
    Outcome.FAILED: "failed",
    Outcome.SKIPPED: "skipped",
    Outcome.NOT_SUPPORTED: "notSupported",
}


def summarize(results: Sequence[PodResult]) -> ResetCounts:
    """The status counts: targets and how many ended in each result (Pending: not final yet)."""
    counts: ResetCounts = {
        "targets": len(results),
        "succeeded": 0,
        "failed": 0,
        "skipped": 0,
        "notSupported": 0,
        "pending": 0,
    }
    for r in results:
        counts[_COUNT_KEY.get(r.result, "pending")] += 1
    return counts


def rank_entry(rank: RankResult) -> RankEntry:
    out: RankEntry = {"rank": rank.rank, "success": rank.success}
    if rank.epoch is not None:
        out["epoch"] = rank.epoch
    if rank.evicted_blocks is not None:
        out["evictedBlocks"] = rank.evicted_blocks
    return out


def pod_entry(result: PodResult) -> PodEntry:
    """One entry of status.pods (empty fields left out: None, an empty string, no tier cleared)."""
    out: PodEntry = {"name": result.name, "result": result.result, "attempts": result.attempts}
    if result.node:
        out["node"] = result.node
    if result.ip:
        out["ip"] = result.ip
    # a fleet pod's target is a fleets.targets.PodTarget, which names its role (not imported: a cycle via kube.api)
    if role := getattr(result.target, "role", ""):
        out["role"] = role
    if result.http_status is not None:
        out["httpStatus"] = result.http_status
    if result.epoch is not None:
        out["epoch"] = result.epoch
    if result.evicted_blocks is not None:
        out["evictedBlocks"] = result.evicted_blocks
    if result.message:
        out["message"] = result.message
    if result.duration_s is not None:
        out["durationSeconds"] = result.duration_s
    if result.ranks is not None:
        out["ranks"] = [rank_entry(r) for r in result.ranks[:MAX_RANKS]]
    if result.reason:
        out["reason"] = result.reason
    if result.cleared:
        out["cleared"] = result.cleared
    if result.verified is not None:
        out["verified"] = result.verified
    if result.verify_message:
        out["verification"] = result.verify_message
    return out


def _said_success(r: PodResult) -> bool:
    """The pod's reset said success: Succeeded, or Failed only because its canary was still warm."""
    return r.result == Outcome.SUCCEEDED or r.reason == STILL_WARM


def verification_counts(results: Sequence[PodResult], verify: bool) -> ResetStatus:
    """status.verified ("cold/said success", or "off") and the verdict counts, for kubectl get."""
    if not verify:
        return {"verified": "off"}
    verdicts = [r.verified for r in results]
    said = sum(1 for r in results if _said_success(r))
    return {
        "verified": f"{verdicts.count(Verified.COLD)}/{said}",
        "verifiedCold": verdicts.count(Verified.COLD),
        "verifiedWarm": verdicts.count(Verified.WARM),
        "verifiedUnknown": verdicts.count(Verified.UNKNOWN),
    }


def pod_status(results: Sequence[PodResult], verify: bool = False) -> ResetStatus:
    """Counts and per-pod detail, bounded: pods not Succeeded first, at most MAX_POD_DETAIL entries;
    `verify`: the reset's spec.verify, for the verification counts."""
    c = summarize(results)
    order = {
        Outcome.FAILED: 0,
        Outcome.NOT_SUPPORTED: 1,
        Outcome.SKIPPED: 2,
        Outcome.PENDING: 3,
        Outcome.SUCCEEDED: 4,
    }
    shown = sorted(results, key=lambda r: (order.get(r.result, 3), r.name))[:MAX_POD_DETAIL]
    status: ResetStatus = {
        "targets": c["targets"],
        "succeeded": c["succeeded"],
        "failed": c["failed"],
        "skipped": c["skipped"],
        "notSupported": c["notSupported"],
        "pending": c["pending"],
        "progress": f"{c['succeeded']}/{c['targets']}",
    }
    status.update(verification_counts(results, verify))
    status["pods"] = [pod_entry(r) for r in shown]
    status["podsOmitted"] = len(results) - len(shown)
    return status


def verified_condition(results: Sequence[PodResult], verify: bool) -> tuple[ConditionStatus, str, str]:
    """(status, reason, message) of the Verified condition of a finished reset. Only pods whose reset said
    success count: a pod that failed or was skipped is the Complete/Failed condition's business."""
    if not verify:
        return "Unknown", "VerificationOff", "spec.verify is false: no pod was verified"
    said = [r for r in results if _said_success(r)]
    if not said:
        return "Unknown", "NothingVerified", "no pod's reset succeeded, so none was verified"
    warm = [r for r in said if r.verified == Verified.WARM]
    if warm:
        return (
            "False",
            STILL_WARM,
            f"{len(warm)}/{len(said)} pods still served their canary from cache after their reset said "
            f"success: {_names([r.name for r in warm])}; {warm[0].name}: {warm[0].verify_message}",
        )
    unsure = [r for r in said if r.verified != Verified.COLD]
    if unsure:
        why = unsure[0].verify_message or "not verified"
        return (
            "Unknown",
            "NotVerified",
            f"{len(said) - len(unsure)}/{len(said)} pods verified cold; not verified: "
            f"{_names([r.name for r in unsure])}; {unsure[0].name}: {why}",
        )
    return (
        "True",
        "AllCold",
        f"{len(said)}/{len(said)} pods verified cold: no canary found more cached than its control",
    )


MAX_NAMED = 5  # pods named in a condition message, per list: the rest are counted (status.pods has them)
_MAX_WHY = 120  # characters of one skip reason in a condition message


def _names(names: Sequence[str], limit: int = MAX_NAMED) -> str:
    more = len(names) - limit
    return ", ".join(names[:limit]) + (f" and {more} more" if more > 0 else "")


# What a reset says of pods created while it ran
NEWCOMERS_WHY = "created during the reset: nothing they cache predates it, not called"


def skipped_note(
    results: Sequence[PodResult], newcomers: Sequence[str] = (), newcomers_why: str = NEWCOMERS_WHY
) -> str:
    """The pods skipped and why, grouped by reason, and the pods created during the reset (what replaced
    the deleted ones): a suffix for the Complete or Failed message, at most MAX_NAMED names per list, so a
    reset with skipped pods never reads as a plain success. Empty when there is nothing to say."""
    groups: dict[str, list[str]] = {}
    skipped = [r for r in results if r.result == Outcome.SKIPPED]
    for r in skipped:
        why = r.message or "not called"
        groups.setdefault(why if len(why) <= _MAX_WHY else why[: _MAX_WHY - 3] + "...", []).append(r.name)
    parts, named = [], 0
    for why, names in groups.items():
        if named >= MAX_NAMED:
            break
        take = names[: MAX_NAMED - named]
        named += len(take)
        parts.append(f"{', '.join(take)} ({why})")
    note = ""
    if parts:
        left = len(skipped) - named
        note = "; skipped " + "; ".join(parts) + (f"; {left} more skipped (status.pods)" if left else "")
    if newcomers:
        why = newcomers_why
        note += (
            f"; replaced by {_names(newcomers)} ({why})"
            if skipped
            else f"; new pods {_names(newcomers)} ({why})"
        )
    return note
