"""PrefixCacheWarmup status from the fan-out's results: exact counts, bounded per-pod entries under the CRD's
camelCase names (crds/prefixcachewarmup.yaml, status.pods), the outcome and the `Warm` condition; its shape
(`WarmupStatus`) and the one place it is read back (`warmup_status`). Counts and the skipped-pods note are
the reset's (resets/status.py): a warm-up's pods end in the same results."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Literal, Required, TypedDict, cast

from kvpilot.fanout import PodResult
from kvpilot.fanout.results import NOT_WARM, STARTING, Outcome, Verified
from kvpilot.operator.kube.conditions import Condition, ConditionStatus
from kvpilot.operator.resets.status import MAX_NAMED, MAX_POD_DETAIL, skipped_note, summarize

WarmupPhase = Literal["Pending", "Running", "Watching", "Succeeded", "Failed"]


class PinEntry(TypedDict, total=False):
    """status.pods[].pin: what the pod's replies said of the pins asked (spec.pin, kvpilot pods)."""

    pinned: Required[bool]
    blocks: Required[int]
    reason: str


class WarmPodEntry(TypedDict, total=False):
    """status.pods[]: one pod's result; a field with nothing to say is left out."""

    name: Required[str]
    result: Required[Outcome]
    attempts: Required[int]
    node: str
    ip: str
    httpStatus: int
    reason: str
    message: str
    verified: Verified
    verification: str
    promptsWarm: int
    ranks: int
    blockSize: int
    promptTokens: int
    cachedTokens: int
    pin: PinEntry
    durationSeconds: float


class WarmupStatus(TypedDict, total=False):
    """A PrefixCacheWarmup's status, or the part of it one write sets (a JSON merge patch)."""

    phase: WarmupPhase
    target: str
    prompts: int
    startTime: str
    completionTime: str
    observedGeneration: int | None
    conditions: list[Condition]
    targets: int
    succeeded: int
    failed: int
    skipped: int
    pending: int
    warm: str  # "verified warm/called", for kubectl get
    warmPods: int
    coldPods: int
    unknownPods: int
    pods: list[WarmPodEntry]
    podsOmitted: int
    passes: int  # mode Continuous: passes over the pods due since the warm-up started
    lastPassTime: str
    lastTrigger: str  # why the last pass warmed its pods (continuous.py: podJoined, reset, ...)


def warmup_status(obj: Mapping[str, Any]) -> WarmupStatus:
    """The status of a PrefixCacheWarmup as read from the API; {} when it has none (the API server checked
    every write against the CRD's schema)."""
    return cast(WarmupStatus, obj.get("status") or {})


def pod_entry(r: PodResult) -> WarmPodEntry:
    out: WarmPodEntry = {"name": r.name, "result": r.result, "attempts": r.attempts}
    for key, value in (
        ("node", r.node),
        ("ip", r.ip),
        ("reason", r.reason),
        ("message", r.message),
        ("verification", r.verify_message),
    ):
        if value:
            out[key] = value  # type: ignore[literal-required]
    if r.http_status is not None:
        out["httpStatus"] = r.http_status
    if r.verified is not None:
        out["verified"] = r.verified
    if r.duration_s is not None:
        out["durationSeconds"] = r.duration_s
    if (w := r.warm) is not None:
        out["promptsWarm"], out["ranks"] = w.warm_prompts, w.ranks
        out["promptTokens"], out["cachedTokens"] = w.prompt_tokens, w.cached_tokens
        if w.block_size is not None:
            out["blockSize"] = w.block_size
        if w.pin is not None:
            out["pin"] = {"pinned": w.pin.pinned, "blocks": w.pin.blocks}
            if w.pin.reason:
                out["pin"]["reason"] = w.pin.reason
    return out


def _called(results: Sequence[PodResult]) -> list[PodResult]:
    return [r for r in results if r.result not in (Outcome.SKIPPED, Outcome.PENDING)]


def pod_status(results: Sequence[PodResult]) -> WarmupStatus:
    """Counts and per-pod detail, bounded: pods not Succeeded first, at most MAX_POD_DETAIL entries."""
    c = summarize(results)
    order = {Outcome.FAILED: 0, Outcome.SKIPPED: 1, Outcome.PENDING: 2, Outcome.SUCCEEDED: 3}
    shown = sorted(results, key=lambda r: (order.get(r.result, 0), r.name))[:MAX_POD_DETAIL]
    verdicts = [r.verified for r in results]
    warm = verdicts.count(Verified.WARM)
    return {
        "targets": c["targets"],
        "succeeded": c["succeeded"],
        "failed": c["failed"] + c["notSupported"],
        "skipped": c["skipped"],
        "pending": c["pending"],
        "warm": f"{warm}/{c['targets'] - c['skipped']}",
        "warmPods": warm,
        "coldPods": verdicts.count(Verified.COLD),
        "unknownPods": verdicts.count(Verified.UNKNOWN),
        "pods": [pod_entry(r) for r in shown],
        "podsOmitted": len(results) - len(shown),
    }


# A warm-up's word on pods created while it ran (the reset's says they cache nothing from before it)
NEWCOMERS_WHY = "created during the warm-up: not warmed, they serve cold until a warm-up reaches them"


def _names(rs: Sequence[PodResult]) -> str:
    more = len(rs) - MAX_NAMED
    return ", ".join(r.name for r in rs[:MAX_NAMED]) + (f" and {more} more" if more > 0 else "")


def outcome(
    results: Sequence[PodResult], allow_no_targets: bool = False, newcomers: Sequence[str] = ()
) -> tuple[WarmupPhase, str, str]:
    """(phase, reason, message) once every pod has a final result: Succeeded when every pod called was warmed
    (verified warm, or unknown: it cannot tell); Failed when one was not (an error, or cold: NotWarm)."""
    c = summarize(results)
    called = _called(results)
    warm = sum(1 for r in called if r.verified == Verified.WARM)
    detail = f"{warm}/{len(called)} pods verified warm, {c['failed']} failed, {c['skipped']} skipped"
    note = skipped_note(results, newcomers, NEWCOMERS_WHY)
    if not called:
        if allow_no_targets:
            return "Succeeded", "NoTargets", f"no pod to warm ({detail}){note}"
        return "Failed", "NoTargets", f"no pod {'called' if c['targets'] else 'matched'} ({detail}){note}"
    bad = [r for r in called if r.result != Outcome.SUCCEEDED]
    if not bad:
        return "Succeeded", "AllPodsWarmed", detail + note
    first = f"; {bad[0].name}: {bad[0].message}"
    if all(r.reason == NOT_WARM for r in bad):
        return "Failed", NOT_WARM, detail + first + note
    return "Failed", "PodsFailed", detail + first + note


def warm_condition(
    results: Sequence[PodResult], newcomers: Sequence[str] = ()
) -> tuple[ConditionStatus, str, str]:
    """(status, reason, message) of the Warm condition of a finished warm-up: True when every pod called was
    verified warm and no pod of the fleet was left out cold (one still starting at the deadline, one created
    during the warm-up); False when one is cold or was not warmed (an error); Unknown when none of those,
    but some could not be verified, or no pod was called."""
    called = _called(results)
    starting = [r.name for r in results if r.result == Outcome.SKIPPED and r.reason == STARTING]
    if starting or newcomers:
        left = [*starting, *newcomers]
        more = f" and {len(left) - MAX_NAMED} more" if len(left) > MAX_NAMED else ""
        return (
            "False",
            "PodsNotWarmed",
            f"not warmed, they will serve cold: {', '.join(left[:MAX_NAMED])}{more}",
        )
    if not called:
        return "Unknown", "NothingWarmed", "no pod was called"
    not_warm = [r for r in called if r.verified == Verified.COLD or r.result != Outcome.SUCCEEDED]
    if not_warm:
        why = not_warm[0].verify_message or not_warm[0].message
        return (
            "False",
            NOT_WARM,
            f"{len(not_warm)}/{len(called)} pods not warm: {_names(not_warm)}; {not_warm[0].name}: {why}",
        )
    unsure = [r for r in called if r.verified != Verified.WARM]
    if unsure:
        return (
            "Unknown",
            "NotVerified",
            f"{len(called) - len(unsure)}/{len(called)} pods verified warm; not verified: {_names(unsure)}; "
            f"{unsure[0].name}: {unsure[0].verify_message or 'not verified'}",
        )
    return (
        "True",
        "AllWarm",
        f"{len(called)}/{len(called)} pods verified warm: every prompt held on every rank",
    )
