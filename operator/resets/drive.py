"""A PrefixCacheReset from start to finish: resolve the targets and the token, fan out, write status, report.

Every reset ends within its timeoutSeconds (counted from status.startTime, so a restart does not extend it):
API errors that may pass (5xx, 429, no connection) are retried until then, others fail the reset with a reason
at once. A target that does not exist fails it at once (TargetNotFound) unless spec.waitForTarget asks to
wait for it until then; an existing fleet whose pods are still coming is waited for.

The first status write comes at first sight, before anything is resolved: phase Pending, the target as the
spec names it and startTime, so `kubectl get pcr` never shows a blank TARGET or PHASE for long.

Flushing twice is harmless, not flushing is the failure, so the fan-out is at-least-once: a reset that an
operator restart interrupted starts over (every pod is called again). With resetRunningRequests a second call
is not harmless (it preempts running requests again), so there it stays at-most-once: `phase: Running` is
written before the first call, and a restarted operator that finds it ends the reset Failed (Interrupted)
without calling anyone.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping, Sequence
from typing import Any, cast

import kopf

from kvpilot.fanout import Outcome, PodResult, ResetSettings, initial_results, run_fanout
from kvpilot.kv.reset_scope import ResetScope
from kvpilot.operator import metrics
from kvpilot.operator.fleets.builders import FLEETS, RESETS
from kvpilot.operator.fleets.status import FleetStatus
from kvpilot.operator.fleets.targets import Plan, describe, list_targets
from kvpilot.operator.kube.api import ApiException, Kube
from kvpilot.operator.kube.conditions import now_iso, parse_time, set_condition
from kvpilot.operator.kube.owners import as_body
from kvpilot.operator.kube.progress import Progress, stop_flag
from kvpilot.operator.kube.retries import RunFailure, with_retries
from kvpilot.operator.resets.podwatch import PodWatch
from kvpilot.operator.resets.status import (
    ResetPhase,
    ResetStatus,
    pod_status,
    reset_status,
    skipped_note,
    summarize,
    verified_condition,
)
from kvpilot.operator.specs import ResetSpec

DONE: tuple[ResetPhase, ...] = ("Succeeded", "Failed")
_MAX_FAILURE_EVENTS = 10  # one Event per failed pod, up to this many per reset
_FINAL_PATCH_GRACE_S = 30.0  # how long the final status write is retried past the deadline


def outcome(
    records: Sequence[PodResult],
    min_success_ratio: float = 1.0,
    allow_no_targets: bool = False,
    newcomers: Sequence[str] = (),
) -> tuple[ResetPhase, str, str]:
    """(phase, reason, message) once every pod has a final result. Skipped pods serve no traffic and do not
    count; of the pods called, at least min_success_ratio must have been reset (default: all). The message
    names the skipped pods with why, and `newcomers` (pods created during the reset) as their replacements."""
    c = summarize(records)
    called = c["targets"] - c["skipped"]
    detail = (
        f"{c['succeeded']}/{c['targets']} pods reset, {c['failed']} failed, {c['skipped']} skipped, "
        f"{c['notSupported']} not supported"
    )
    note = skipped_note(records, newcomers)
    if called == 0:
        if allow_no_targets:
            return "Succeeded", "NoTargets", f"no pod to reset ({detail}){note}"
        if not c["targets"]:
            return "Failed", "NoTargets", f"no pod matched ({detail}){note}"
        return "Failed", "NoTargets", f"no pod called ({detail}){note}"
    bad = next((r for r in records if r.result in (Outcome.FAILED, Outcome.NOT_SUPPORTED)), None)
    if bad is None:
        return "Succeeded", "AllPodsReset", detail + note
    first = f"; {bad.name}: {bad.message}"
    if c["succeeded"] >= min_success_ratio * called:
        return (
            "Succeeded",
            "MinSuccessRatioMet",
            f"{detail} (minSuccessRatio {min_success_ratio:g}){first}{note}",
        )
    if not c["failed"]:
        return "Failed", "ResetNotSupported", detail + first + note
    return "Failed", "PodsFailed", detail + first + note


def settings_for(spec: ResetSpec, plan: Plan) -> ResetSettings:
    return ResetSettings(
        engine=spec.engine,
        port=plan.port,
        token=plan.token,
        reset_running_requests=spec.reset_running_requests,
        reset_external=spec.reset_external,
        scope=None if spec.scope is None else ResetScope(**spec.scope.model_dump()),
        verify=spec.verify,
        timeout_s=float(spec.timeout_seconds),
        request_timeout_s=float(spec.request_timeout_seconds or min(10, spec.timeout_seconds)),
        max_concurrency=spec.max_concurrency,
        retries_per_pod=spec.retries_per_pod,
    )


def unfinished(status: Mapping[str, Any], **_: Any) -> bool:
    """kopf's filter of the reset daemon: a finished reset runs nothing, so kopf keeps no finalizer on it."""
    return (status or {}).get("phase") not in DONE


async def drive(
    kube: Kube,
    ns: str,
    name: str,
    logger: kopf.Logger,
    stopped: Any = None,
    limiter: asyncio.Semaphore | None = None,
) -> None:
    """Run the reset unless it is finished (its TTL is reset_expiry's)."""
    obj = await kube.get_cr(RESETS, ns, name)
    if obj is None or not unfinished(reset_status(obj)):
        return
    metrics.RESETS_IN_PROGRESS.inc()
    try:
        await _run(kube, obj, logger, stopped, limiter)
    finally:
        metrics.RESETS_IN_PROGRESS.dec()


async def _patch(kube: Kube, ns: str, name: str, status: ResetStatus) -> dict[str, Any]:
    metrics.STATUS_PATCHES.inc()
    return await kube.patch_status(RESETS, ns, name, status)


async def _run(
    kube: Kube, obj: dict[str, Any], logger: kopf.Logger, stopped: Any, limiter: asyncio.Semaphore | None
) -> dict[str, Any] | None:
    """Run the reset to its end; None when the operator stops first (the next one starts it over)."""
    ns, name = obj["metadata"]["namespace"], obj["metadata"]["name"]
    spec, status = ResetSpec.parse(obj["spec"]), reset_status(obj)
    start = status.get("startTime") or now_iso()
    started = parse_time(status.get("startTime"))  # a restart keeps the first run's deadline
    deadline = time.monotonic() + spec.timeout_seconds - (time.time() - started if started else 0)
    if status.get("phase") == "Running" and spec.reset_running_requests:
        return await _finish(
            kube,
            obj,
            spec,
            None,
            "Failed",
            "Interrupted",
            "the operator restarted while this reset ran; with resetRunningRequests a pod is "
            "never called twice (a second call preempts running requests again): create a new "
            "PrefixCacheReset to reset the pods again",
            start,
        )
    if status.get("phase") == "Running":
        logger.info("reset %s/%s: interrupted by an operator restart; calling every pod again", ns, name)
    progress = Progress(
        lambda st: _patch(kube, ns, name, cast(ResetStatus, st)), f"reset {ns}/{name}", logger
    )
    if not status.get("phase"):  # first sight: TARGET and PHASE for kubectl get, the deadline's start
        gen = obj["metadata"].get("generation")
        first: ResetStatus = {
            "phase": "Pending",
            "target": describe(spec),
            "startTime": start,
            "observedGeneration": gen,
        }
        progress.write(first, "Pending")  # on its way while the targets are resolved and listed
    try:
        listed = await list_targets(kube, ns, spec, deadline, logger)
        plan, pods, targets = listed.plan, listed.pods, listed.targets
        before = initial_results(targets)  # what status shows until the fan-out's first checkpoint
        running: ResetStatus = {
            "phase": "Running",
            "target": plan.description,
            "startTime": start,
            "observedGeneration": obj["metadata"].get("generation"),
        }
        if spec.reset_running_requests:  # at-most-once: recorded before any call, or no call at all
            await progress.settle()
            await with_retries(
                "status",
                lambda: _patch(kube, ns, name, {**running, **pod_status(before, spec.verify)}),
                deadline,
            )
        else:  # progress for people only: the calls do not wait for it
            progress.write({**running, **pod_status(before, spec.verify)}, "Running")
        kopf.event(
            as_body(obj),
            type="Normal",
            reason="Started",
            message=f"resetting the prefix caches of {len(targets)} pods of {plan.description}",
        )
        idents = {t.name: ident for t, ident in pods}
        async with (
            PodWatch(kube, ns, plan.selector, plan.container, idents, listed.version) as watch,
            stop_flag(stopped) as stop,
        ):
            results = await run_fanout(
                targets,
                settings_for(spec, plan),
                deadline=deadline,
                # shielded: when the fan-out ends it cancels its progress task, not a write on its way
                checkpoint=lambda now: asyncio.shield(
                    progress.write({**running, **pod_status(now, spec.verify)}, "progress")
                ),
                pod_gone=watch.gone,  # asked before every call
                pod_starting=watch.starting,  # a pod loading its model is waited for, not failed
                limiter=limiter,
                stop=stop,
                on_call=metrics.count_pod_call,
            )
            newcomers = watch.newcomers()  # the pods that replaced those skipped as gone, for the message
    except RunFailure as f:
        logger.warning("reset %s/%s: %s: %s", ns, name, f.reason, f.message)
        await progress.settle()  # the final status lands last
        return await _finish(kube, obj, spec, None, "Failed", f.reason, f.message, start)
    await progress.settle()
    if any(r.result == Outcome.PENDING for r in results):
        logger.info(
            "reset %s/%s: stopped before every pod was reset; the next operator starts it over", ns, name
        )
        return None
    phase, reason, message = outcome(results, spec.min_success_ratio, spec.allow_no_targets, newcomers)
    logger.info("reset %s/%s: %s", ns, name, message)
    for r in [r for r in results if r.result == Outcome.FAILED][:_MAX_FAILURE_EVENTS]:
        kopf.event(as_body(obj), type="Warning", reason="PodResetFailed", message=f"{r.name}: {r.message}")
    return await _finish(kube, obj, spec, results, phase, reason, message, start)


async def _finish(
    kube: Kube,
    obj: dict[str, Any],
    spec: ResetSpec,
    records: list[PodResult] | None,
    phase: ResetPhase,
    reason: str,
    message: str,
    start: str,
) -> dict[str, Any]:
    """The reset's end. Its final status write comes last: once it lands, the daemon's filter (`unfinished`)
    no longer matches and kopf cancels the daemon at once, which is how the finalizer goes; so the Event,
    the metrics and the target's lastReset come first."""
    ns, name = obj["metadata"]["namespace"], obj["metadata"]["name"]
    gen = obj["metadata"].get("generation") or 1
    conds = reset_status(obj).get("conditions")
    conds = set_condition(conds, "Complete" if phase == "Succeeded" else "Failed", True, reason, message, gen)
    # after Complete/Failed: readers that take the first True condition (kubectl describe, scripts) see the end
    conds = set_condition(conds, "Verified", *verified_condition(records or [], spec.verify), gen)
    end = now_iso()
    kopf.event(
        as_body(obj), type="Normal" if phase == "Succeeded" else "Warning", reason=phase, message=message
    )
    metrics.RESETS.labels(ns, phase).inc()
    if (t0 := parse_time(start)) is not None:
        metrics.RESET_DURATION.observe(max(0.0, time.time() - t0))
    metrics.record_reset_pods(ns, name, summarize(records or []))
    metrics.count_verifications(ns, records or [])
    if spec.target_ref:
        target = spec.target_ref.name
        try:
            last: FleetStatus = {"lastReset": {"name": name, "time": end, "result": phase}}
            await kube.patch_status(FLEETS, ns, target, last)
        except ApiException as exc:  # the fleet's status is informative; the reset's own status is written
            if exc.status != 404:
                logging.getLogger(__name__).warning(
                    "lastReset of %s/%s not written: %s", ns, target, exc.reason
                )
    body: ResetStatus = {
        "phase": phase,
        "completionTime": end,
        "startTime": start,
        "conditions": conds,
        "observedGeneration": gen,
    }
    if records is not None:
        body.update(pod_status(records, spec.verify))
    # 401/403 are retried too: a kube-apiserver that has just restarted answers them until its authenticator
    # and RBAC caches are filled, and giving up here would make kopf run the whole reset again a minute later.
    return await with_retries(
        "final status",
        lambda: _patch(kube, ns, name, body),
        time.monotonic() + _FINAL_PATCH_GRACE_S,
        also=(401, 403),
    )
