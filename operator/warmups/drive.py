"""A PrefixCacheWarmup from start to finish (mode Once; mode Continuous hands over to continuous.py once its
prompts are read and its target resolved): load its prompts, resolve and list its pods as a
reset does (fleets/targets.py), send every prompt to every pod and rank and verify each pod warm
(kvpilot.fanout.warmup), write status, report.

Every warm-up ends within its timeoutSeconds, counted from status.startTime (a restart does not extend it).
Sending a prompt twice is harmless, so a warm-up that an operator restart interrupted starts over: every pod
is warmed again (at-least-once, as a reset without resetRunningRequests). A pod still loading its model is
waited for (the pod watch's `starting`), Skipped with reason Starting if it still is at the deadline.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping, Sequence
from typing import Any, cast

import kopf

from kvpilot.fanout import Outcome, PodResult, initial_results
from kvpilot.fanout.warmup import WarmPrompt, WarmSettings, run_warmup
from kvpilot.operator import metrics
from kvpilot.operator.fleets.builders import WARMUPS
from kvpilot.operator.fleets.targets import Plan, describe, list_targets, resolve
from kvpilot.operator.kube.api import Kube
from kvpilot.operator.kube.conditions import now_iso, parse_time, set_condition
from kvpilot.operator.kube.owners import as_body
from kvpilot.operator.kube.progress import Progress, stop_flag
from kvpilot.operator.kube.retries import RunFailure, with_retries
from kvpilot.operator.resets.podwatch import PodWatch
from kvpilot.operator.specs import WarmupSpec
from kvpilot.operator.warmups import continuous, prompts
from kvpilot.operator.warmups.status import (
    WarmupPhase,
    WarmupStatus,
    outcome,
    pod_status,
    warm_condition,
    warmup_status,
)

DONE: tuple[WarmupPhase, ...] = ("Succeeded", "Failed")
_MAX_FAILURE_EVENTS = 10  # one Event per pod not warmed, up to this many per warm-up
_FINAL_PATCH_GRACE_S = 30.0  # how long the final status write is retried past the deadline
_MAX_REQUEST_TIMEOUT_S = 60.0  # one prompt's prefill on one pod: long prompts on CPUs take seconds


def unfinished(status: Mapping[str, Any], **_: Any) -> bool:
    """kopf's filter of the warm-up daemon: a finished warm-up runs nothing, so kopf keeps no finalizer."""
    return (status or {}).get("phase") not in DONE


def settings_for(spec: WarmupSpec, plan: Plan, sends: tuple[WarmPrompt, ...]) -> WarmSettings:
    return WarmSettings(
        engine=spec.engine,
        prompts=sends,
        pin=spec.pin,
        port=plan.port,
        token=plan.token,
        timeout_s=float(spec.timeout_seconds),
        request_timeout_s=min(_MAX_REQUEST_TIMEOUT_S, float(spec.timeout_seconds)),
        max_concurrency=spec.max_concurrency,
    )


async def drive(
    kube: Kube,
    ns: str,
    name: str,
    logger: kopf.Logger,
    stopped: Any = None,
    limiter: asyncio.Semaphore | None = None,
) -> None:
    """Run the warm-up unless it is finished (its TTL is the expiry's)."""
    obj = await kube.get_cr(WARMUPS, ns, name)
    if obj is None or not unfinished(warmup_status(obj)):
        return
    metrics.WARMUPS_IN_PROGRESS.inc()
    try:
        await _run(kube, obj, logger, stopped, limiter)
    finally:
        metrics.WARMUPS_IN_PROGRESS.dec()


async def _patch(kube: Kube, ns: str, name: str, status: Mapping[str, Any]) -> dict[str, Any]:
    return await kube.patch_status(WARMUPS, ns, name, status)


async def _run(
    kube: Kube, obj: dict[str, Any], logger: kopf.Logger, stopped: Any, limiter: asyncio.Semaphore | None
) -> dict[str, Any] | None:
    """Run the warm-up to its end; None when the operator stops first (the next one starts it over)."""
    ns, name = obj["metadata"]["namespace"], obj["metadata"]["name"]
    spec, status = WarmupSpec.parse(obj["spec"]), warmup_status(obj)
    start = status.get("startTime") or now_iso()
    started = parse_time(status.get("startTime"))  # a restart keeps the first run's deadline
    deadline = time.monotonic() + spec.timeout_seconds - (time.time() - started if started else 0)
    if spec.mode == "Continuous":  # timeoutSeconds bounds each pass, not the warm-up
        deadline = time.monotonic() + spec.timeout_seconds
    if status.get("phase") in ("Running", "Watching"):
        logger.info("warm-up %s/%s: interrupted by an operator restart; warming every pod again", ns, name)
    progress = Progress(lambda st: _patch(kube, ns, name, st), f"warm-up {ns}/{name}", logger)
    gen = obj["metadata"].get("generation")
    if not status.get("phase"):  # first sight: TARGET and PHASE for kubectl get, the deadline's start
        first: WarmupStatus = {"phase": "Pending", "target": describe(spec), "startTime": start}
        progress.write({**first, "observedGeneration": gen}, "Pending")
    try:
        sends = await prompts.load(kube, ns, spec, deadline)
        if spec.mode == "Continuous":
            plan = await resolve(kube, ns, spec, deadline)  # a target that cannot be resolved fails it
            kopf.event(
                as_body(obj),
                type="Normal",
                reason="Started",
                message=f"keeping the pods of {plan.description} warm with {len(sends)} prompts",
            )
            await progress.settle()  # the first-sight write lands before the loop's
            async with stop_flag(stopped) as stop:
                loop = continuous.Loop(kube, obj, spec, sends, logger, stop, limiter, start)
                await loop.run(plan)
            return None  # it ends only when the operator stops or the warm-up is deleted
        listed = await list_targets(kube, ns, spec, deadline, logger)
        plan, targets = listed.plan, listed.targets
        running: WarmupStatus = {
            "phase": "Running",
            "target": plan.description,
            "startTime": start,
            "prompts": len(sends),
            "observedGeneration": gen,
        }
        progress.write({**running, **pod_status(initial_results(targets))}, "Running")
        kopf.event(
            as_body(obj),
            type="Normal",
            reason="Started",
            message=f"warming {len(targets)} pods of {plan.description} with {len(sends)} prompts",
        )
        idents = {t.name: ident for t, ident in listed.pods}
        async with (
            PodWatch(kube, ns, plan.selector, plan.container, idents, listed.version, "warm-up") as watch,
            stop_flag(stopped) as stop,
        ):
            results = await run_warmup(
                targets,
                settings_for(spec, plan, sends),
                deadline=deadline,
                # shielded: when the fan-out ends it cancels its progress task, not a write on its way
                checkpoint=lambda now: asyncio.shield(
                    progress.write({**running, **pod_status(now)}, "progress")
                ),
                pod_gone=watch.gone,  # asked before every call: a token never goes to a stale address
                pod_starting=watch.starting,  # a pod loading its model is waited for, not failed
                limiter=limiter,
                stop=stop,
                on_call=metrics.count_warmup_call,
            )
            newcomers = watch.newcomers()
    except RunFailure as f:
        logger.warning("warm-up %s/%s: %s: %s", ns, name, f.reason, f.message)
        await progress.settle()  # the final status lands last
        return await _finish(kube, obj, None, "Failed", f.reason, f.message, start)
    await progress.settle()
    if any(r.result == Outcome.PENDING for r in results):
        logger.info(
            "warm-up %s/%s: stopped before every pod was warmed; the next operator starts it over", ns, name
        )
        return None
    phase, reason, message = outcome(results, spec.allow_no_targets, newcomers)
    logger.info("warm-up %s/%s: %s", ns, name, message)
    for r in [r for r in results if r.result == Outcome.FAILED][:_MAX_FAILURE_EVENTS]:
        kopf.event(as_body(obj), type="Warning", reason="PodNotWarmed", message=f"{r.name}: {r.message}")
    return await _finish(kube, obj, results, phase, reason, message, start, newcomers)


async def _finish(
    kube: Kube,
    obj: dict[str, Any],
    records: list[PodResult] | None,
    phase: WarmupPhase,
    reason: str,
    message: str,
    start: str,
    newcomers: Sequence[str] = (),
) -> dict[str, Any]:
    """The warm-up's end: Event and metrics first, the final status write last (once it lands, the daemon's
    filter no longer matches and kopf stops the daemon)."""
    ns, name = obj["metadata"]["namespace"], obj["metadata"]["name"]
    gen = obj["metadata"].get("generation") or 1
    conds = warmup_status(obj).get("conditions")
    conds = set_condition(conds, "Complete" if phase == "Succeeded" else "Failed", True, reason, message, gen)
    # after Complete/Failed: readers that take the first True condition see the end
    conds = set_condition(conds, "Warm", *warm_condition(records or [], newcomers), gen)
    kopf.event(
        as_body(obj), type="Normal" if phase == "Succeeded" else "Warning", reason=phase, message=message
    )
    metrics.WARMUPS.labels(ns, phase).inc()
    if (t0 := parse_time(start)) is not None:
        metrics.WARMUP_DURATION.observe(max(0.0, time.time() - t0))
    metrics.count_warmup_pods(ns, records or [])
    body: WarmupStatus = {
        "phase": phase,
        "completionTime": now_iso(),
        "startTime": start,
        "conditions": conds,
        "observedGeneration": gen,
    }
    if records is not None:
        body.update(pod_status(records))
    # 401/403 retried too, as a reset's final write is (resets/drive.py): an API server just restarted
    return await with_retries(
        "final status",
        lambda: _patch(kube, ns, name, cast(Mapping[str, Any], body)),
        time.monotonic() + _FINAL_PATCH_GRACE_S,
        also=(401, 403),
    )
