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
import contextlib
import json
import logging
import random
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import kopf

from kvpilot.fanout import FanoutSettings, PodResult, Target, initial_results, run_fanout
from kvpilot.fleet_members import is_member, workload_controllers
from kvpilot.operator import builders, metrics, tokens
from kvpilot.operator.builders import FLEETS, RESETS
from kvpilot.operator.conditions import now_iso, parse_time, set_condition
from kvpilot.operator.kube import ApiException, Kube, is_transient
from kvpilot.operator.owners import controlled_by
from kvpilot.operator.podwatch import PodWatch, identity
from kvpilot.operator.reset_status import pod_status, skipped_note, summarize

DONE = ("Succeeded", "Failed")
_MAX_FAILURE_EVENTS = 10  # one Event per failed pod, up to this many per reset
_FINAL_PATCH_GRACE_S = 30.0  # how long the final status write is retried past the deadline


class ResetFailure(Exception):
    """The reset cannot go on: it ends Failed with this reason."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason, self.message = reason, message


_API_REASONS = {400: "InvalidRequest", 401: "Unauthorized", 403: "Forbidden", 404: "NotFound", 422: "Invalid"}


def _api_message(exc: ApiException) -> str:
    try:
        return json.loads(exc.body or "{}").get("message") or str(exc.reason)
    except (ValueError, AttributeError):
        return str(exc.reason)


async def with_retries(
    what: str, call: Callable[[], Awaitable[Any]], deadline: float, also: tuple[int, ...] = ()
) -> Any:
    """`call()`, retried with backoff on transient API errors (and on the statuses in `also`) until the
    deadline; any other API error (4xx) ends the reset with a specific reason."""
    n = 0
    while True:
        try:
            return await call()
        except ApiException as exc:
            if not is_transient(exc) and exc.status not in also:
                raise ResetFailure(
                    _API_REASONS.get(exc.status, "ApiError"),
                    f"{what}: HTTP {exc.status}: {_api_message(exc)}",
                ) from exc
            last: BaseException = exc
        except Exception as exc:
            if not is_transient(exc):
                raise
            last = exc
        n += 1
        delay = min(5.0, 0.2 * 2 ** (n - 1)) * random.uniform(0.5, 1.0)
        if time.monotonic() + delay >= deadline:
            raise ResetFailure("ApiUnavailable", f"{what}: {last} (tried {n} times until timeoutSeconds)")
        await asyncio.sleep(delay)


@dataclass(frozen=True, slots=True)
class Plan:
    """What a reset is aimed at, resolved from its spec."""

    description: str  # InferenceDeployment/NAME or the selector
    selector: str  # label selector of the candidate pods
    port: int
    token: str | None
    container: str | None  # the engine container that must be running; None: any container
    controllers: frozenset[str] | None  # uids that must control a pod (its fleet's workload), None: any
    waits_for_pods: bool = False  # a fleet that wants pods but has none to call yet is waited for


def pod_target(pod: dict[str, Any], plan: Plan) -> Target:
    """A candidate pod as a target: called when it has an IP and a running engine container (Ready or not:
    a pod that is briefly not Ready rejoins the Service later with whatever it cached)."""
    meta, spec, st = pod["metadata"], pod.get("spec") or {}, pod.get("status") or {}
    skip = ""
    running = {
        c.get("name") for c in st.get("containerStatuses") or [] if "running" in (c.get("state") or {})
    }
    if meta.get("deletionTimestamp"):
        skip = "pod is terminating"
    elif plan.controllers is not None and not is_member(pod, plan.controllers):
        skip = "pod is not run by the InferenceDeployment's workload: its admin token is not sent there"
    elif not st.get("podIP"):
        skip = f"pod has no IP (phase {st.get('phase')})"
    elif (plan.container not in running) if plan.container else not running:
        skip = f"no running engine container{f' {plan.container!r}' if plan.container else ''} (phase {st.get('phase')})"
    return Target(
        meta["name"], st.get("podIP") or "", spec.get("nodeName", ""), meta.get("uid", ""), skip_reason=skip
    )


async def _token(
    kube: Kube, ns: str, ref: dict[str, Any], deadline: float, use: str, owner_uid: str | None
) -> str:
    """The token of `ref`, if its Secret consents to being sent (tokens.refusal); `owner_uid`: the targeted
    InferenceDeployment, whose own Secret counts as consented."""
    secret = await with_retries(f"Secret {ns}/{ref['name']}", lambda: kube.secret(ns, ref["name"]), deadline)
    if problem := tokens.refusal(secret, ns, ref, owner_uid, use):
        raise ResetFailure(*problem)
    assert secret is not None
    return secret["data"][ref.get("key", "token")].strip()


async def _fleet_controllers(kube: Kube, ns: str, fleet: dict[str, Any], deadline: float) -> frozenset[str]:
    """uids of the objects that directly control the fleet's pods (fleet_members.workload_controllers)."""
    name, uid = fleet["metadata"]["name"], fleet["metadata"]["uid"]
    kind = builders.workload_kind(fleet.get("spec") or {})
    wl = await with_retries(f"{kind} {ns}/{name}", lambda: kube.read(kind, ns, name), deadline)
    if wl is None or not controlled_by(wl, uid) or kind == "DaemonSet":
        return workload_controllers(uid, wl, ())
    sel = builders.selector_string(name)
    rsets = await with_retries("list ReplicaSets", lambda: kube.list_replicasets(ns, sel), deadline)
    return workload_controllers(uid, wl, rsets)


def describe(spec: dict[str, Any]) -> str:
    """status.target, from the spec alone: InferenceDeployment/NAME, or the selector."""
    if spec.get("targetRef"):
        return f"InferenceDeployment/{spec['targetRef']['name']}"
    return builders.label_selector(spec["selector"])


async def resolve(kube: Kube, ns: str, spec: dict[str, Any], deadline: float) -> Plan:
    """The reset's targets and token; raises ResetFailure with a reason when it cannot go on."""
    if not spec.get("targetRef"):
        sel = builders.label_selector(spec["selector"])
        ref = spec.get("adminTokenSecretRef")
        token = await _token(kube, ns, ref, deadline, "adminTokenSecretRef", None) if ref else None
        return Plan(sel, sel, int(spec.get("port") or 8000), token, None, None)
    name = spec["targetRef"]["name"]
    while (
        fleet := await with_retries(
            f"InferenceDeployment {ns}/{name}", lambda: kube.get_cr(FLEETS, ns, name), deadline
        )
    ) is None:
        if not spec.get("waitForTarget"):
            hint = "set spec.waitForTarget: true to wait for it until timeoutSeconds"
            raise ResetFailure("TargetNotFound", f"InferenceDeployment {ns}/{name} not found ({hint})")
        if time.monotonic() >= deadline - 0.05:  # waited for it to appear until the deadline
            waited = f"timeoutSeconds ({spec.get('timeoutSeconds', 60)}s, waitForTarget)"
            raise ResetFailure("TargetNotFound", f"InferenceDeployment {ns}/{name} not found within {waited}")
        await asyncio.sleep(max(0.0, min(1.0, deadline - 0.05 - time.monotonic())))
    fspec = fleet.get("spec") or {}
    ref = builders.token_secret_ref(name, fspec)
    use = f"the admin token of {name}"
    token = await _token(kube, ns, ref, deadline, use, fleet["metadata"]["uid"]) if ref else None
    controllers = await _fleet_controllers(kube, ns, fleet, deadline)
    wants_pods = builders.workload_kind(fspec) == "DaemonSet" or int(fspec.get("replicas", 1)) > 0
    return Plan(
        f"InferenceDeployment/{name}",
        builders.selector_string(name),
        int(spec.get("port") or fspec.get("port", 8000)),
        token,
        builders.CONTAINER,
        controllers,
        wants_pods,
    )


def outcome(
    records: Sequence[PodResult],
    min_success_ratio: float = 1.0,
    allow_no_targets: bool = False,
    newcomers: Sequence[str] = (),
) -> tuple[str, str, str]:
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
    bad = next((r for r in records if r.result in ("Failed", "NotSupported")), None)
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


def settings_for(spec: dict[str, Any], plan: Plan) -> FanoutSettings:
    return FanoutSettings(
        engine=spec.get("engine", "kvpilot"),
        port=plan.port,
        token=plan.token,
        reset_running_requests=bool(spec.get("resetRunningRequests")),
        timeout_s=float(spec.get("timeoutSeconds", 60)),
        request_timeout_s=float(spec.get("requestTimeoutSeconds") or min(10, spec.get("timeoutSeconds", 60))),
        max_concurrency=int(spec.get("maxConcurrency", 64)),
        retries_per_pod=int(spec.get("retriesPerPod", 3)),
    )


def unfinished(status: dict[str, Any], **_: Any) -> bool:
    """kopf's filter of the reset daemon: a finished reset runs nothing, so kopf keeps no finalizer on it."""
    return (status or {}).get("phase") not in DONE


async def drive(
    kube: Kube,
    ns: str,
    name: str,
    logger: logging.Logger,
    stopped: Any = None,
    limiter: asyncio.Semaphore | None = None,
) -> None:
    """Run the reset unless it is finished (its TTL is reset_expiry's)."""
    obj = await kube.get_cr(RESETS, ns, name)
    if obj is None or not unfinished(obj.get("status") or {}):
        return
    metrics.RESETS_IN_PROGRESS.inc()
    try:
        await _run(kube, obj, logger, stopped, limiter)
    finally:
        metrics.RESETS_IN_PROGRESS.dec()


async def _patch(kube: Kube, ns: str, name: str, status: dict[str, Any]) -> dict[str, Any]:
    metrics.STATUS_PATCHES.inc()
    return await kube.patch_status(RESETS, ns, name, status)


class _Progress:
    """The status writes for people (Pending at first sight, Running, each checkpoint): best effort, in
    order (each waits for the one before), and none holds up what it reports (the list, the calls), so a
    reset's first calls leave while its Running status is on its way. A write is never cancelled halfway
    (its request would still land, maybe after the final status): `settle` waits for them all."""

    def __init__(self, kube: Kube, ns: str, name: str, logger: logging.Logger) -> None:
        self.kube, self.ns, self.name, self.logger = kube, ns, name, logger
        self._last: asyncio.Task[None] | None = None

    def write(self, status: dict[str, Any], what: str) -> asyncio.Task[None]:
        before = self._last

        async def go() -> None:
            if before is not None:
                await asyncio.wait([before])
            try:
                await _patch(self.kube, self.ns, self.name, status)
            except Exception as exc:  # noqa: BLE001 - for people only
                self.logger.warning("reset %s/%s: %s not written: %s", self.ns, self.name, what, exc)

        self._last = asyncio.create_task(go())
        return self._last

    async def settle(self) -> None:
        """Wait for the writes started so far: the next write must land after them."""
        if self._last is not None:
            await asyncio.wait([self._last])


async def _run(
    kube: Kube, obj: dict[str, Any], logger: logging.Logger, stopped: Any, limiter: asyncio.Semaphore | None
) -> dict[str, Any] | None:
    """Run the reset to its end; None when the operator stops first (the next one starts it over)."""
    ns, name = obj["metadata"]["namespace"], obj["metadata"]["name"]
    spec, status = obj["spec"], obj.get("status") or {}
    start = status.get("startTime") or now_iso()
    started = parse_time(status.get("startTime"))  # a restart keeps the first run's deadline
    deadline = time.monotonic() + spec.get("timeoutSeconds", 60) - (time.time() - started if started else 0)
    if status.get("phase") == "Running" and spec.get("resetRunningRequests"):
        return await _finish(
            kube,
            obj,
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
    progress = _Progress(kube, ns, name, logger)
    if not status.get("phase"):  # first sight: TARGET and PHASE for kubectl get, the deadline's start
        gen = obj["metadata"].get("generation")
        first = {"phase": "Pending", "target": describe(spec), "startTime": start, "observedGeneration": gen}
        progress.write(first, "Pending")  # on its way while the targets are resolved and listed
    try:
        while True:
            plan = await resolve(kube, ns, spec, deadline)
            t_list = time.monotonic()
            # Each pod is looked at once, as it is decoded: its target, and its identity for the pod watch.
            pods, version = await with_retries(
                "list pods",
                lambda plan=plan: kube.list_pods(
                    ns, plan.selector, lambda p: (pod_target(p, plan), identity(p))
                ),
                deadline,
            )
            targets = [t for t, _ in pods]
            before = initial_results(targets)  # what status shows until the fan-out's first checkpoint
            logger.info(
                "reset %s/%s: listed %d pods in %.3fs", ns, name, len(targets), time.monotonic() - t_list
            )
            if any(r.result == "Pending" for r in before) or not plan.waits_for_pods:
                break
            if time.monotonic() >= deadline - 1.0:
                break  # NoTargets
            await asyncio.sleep(1.0)  # a fleet just created: its pods are coming
        running = {
            "phase": "Running",
            "target": plan.description,
            "startTime": start,
            "observedGeneration": obj["metadata"].get("generation"),
        }
        if spec.get("resetRunningRequests"):  # at-most-once: recorded before any call, or no call at all
            await progress.settle()
            await with_retries(
                "status", lambda: _patch(kube, ns, name, {**running, **pod_status(before)}), deadline
            )
        else:  # progress for people only: the calls do not wait for it
            progress.write({**running, **pod_status(before)}, "Running")
        kopf.event(
            obj,
            type="Normal",
            reason="Started",
            message=f"resetting the prefix caches of {len(targets)} pods of {plan.description}",
        )
        listed = {t.name: ident for t, ident in pods}
        async with PodWatch(kube, ns, plan.selector, listed, version) as watch, _stop_flag(stopped) as stop:
            results = await run_fanout(
                targets,
                settings_for(spec, plan),
                deadline=deadline,
                # shielded: when the fan-out ends it cancels its progress task, not a write on its way
                checkpoint=lambda now: asyncio.shield(
                    progress.write({**running, **pod_status(now)}, "progress")
                ),
                pod_gone=watch.gone,  # asked before every call
                limiter=limiter,
                stop=stop,
                on_call=metrics.count_pod_call,
            )
            newcomers = watch.newcomers()  # the pods that replaced those skipped as gone, for the message
    except ResetFailure as f:
        logger.warning("reset %s/%s: %s: %s", ns, name, f.reason, f.message)
        await progress.settle()  # the final status lands last
        return await _finish(kube, obj, None, "Failed", f.reason, f.message, start)
    await progress.settle()
    if any(r.result == "Pending" for r in results):
        logger.info(
            "reset %s/%s: stopped before every pod was reset; the next operator starts it over", ns, name
        )
        return None
    ratio, allow_none = float(spec.get("minSuccessRatio", 1.0)), bool(spec.get("allowNoTargets"))
    phase, reason, message = outcome(results, ratio, allow_none, newcomers)
    logger.info("reset %s/%s: %s", ns, name, message)
    for r in [r for r in results if r.result == "Failed"][:_MAX_FAILURE_EVENTS]:
        kopf.event(obj, type="Warning", reason="PodResetFailed", message=f"{r.name}: {r.message}")
    return await _finish(kube, obj, results, phase, reason, message, start)


@contextlib.asynccontextmanager
async def _stop_flag(stopped: Any) -> AsyncIterator[asyncio.Event]:
    """An asyncio.Event set when kopf's `stopped` flag is (the operator stops), for the fan-out's `stop`."""
    stop = asyncio.Event()

    async def bridge() -> None:
        if stopped is not None:
            await stopped.wait()
            stop.set()

    bridging = asyncio.create_task(bridge())
    try:
        yield stop
    finally:
        bridging.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await bridging


async def _finish(
    kube: Kube,
    obj: dict[str, Any],
    records: list[PodResult] | None,
    phase: str,
    reason: str,
    message: str,
    start: str,
) -> dict[str, Any]:
    """The reset's end. Its final status write comes last: once it lands, the daemon's filter (`unfinished`)
    no longer matches and kopf cancels the daemon at once, which is how the finalizer goes; so the Event,
    the metrics and the target's lastReset come first."""
    ns, name = obj["metadata"]["namespace"], obj["metadata"]["name"]
    gen = obj["metadata"].get("generation") or 1
    conds = (obj.get("status") or {}).get("conditions")
    conds = set_condition(conds, "Complete" if phase == "Succeeded" else "Failed", True, reason, message, gen)
    end = now_iso()
    kopf.event(obj, type="Normal" if phase == "Succeeded" else "Warning", reason=phase, message=message)
    metrics.RESETS.labels(ns, phase).inc()
    if (t0 := parse_time(start)) is not None:
        metrics.RESET_DURATION.observe(max(0.0, time.time() - t0))
    metrics.record_reset_pods(ns, name, summarize(records or []))
    target = (obj["spec"].get("targetRef") or {}).get("name")
    if target:
        try:
            await kube.patch_status(
                FLEETS, ns, target, {"lastReset": {"name": name, "time": end, "result": phase}}
            )
        except ApiException as exc:  # the fleet's status is informative; the reset's own status is written
            if exc.status != 404:
                logging.getLogger(__name__).warning(
                    "lastReset of %s/%s not written: %s", ns, target, exc.reason
                )
    body = {
        "phase": phase,
        "completionTime": end,
        "startTime": start,
        "conditions": conds,
        "observedGeneration": gen,
        **(pod_status(records) if records is not None else {}),
    }
    # 401/403 are retried too: a kube-apiserver that has just restarted answers them until its authenticator
    # and RBAC caches are filled, and giving up here would make kopf run the whole reset again a minute later.
    return await with_retries(
        "final status",
        lambda: _patch(kube, ns, name, body),
        time.monotonic() + _FINAL_PATCH_GRACE_S,
        also=(401, 403),
    )
