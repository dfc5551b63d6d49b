"""A PrefixCacheReset from start to finish: resolve targets, fan out, write status in few patches, report.

Everything that must survive an operator restart is in status (targets, per-pod results, Dispatched marks),
so `drive` can be called again at any time and continues where the last run stopped.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
import time
from typing import Any

import kopf

from kvpilot.operator import metrics
from kvpilot.operator.builders import selector_string
from kvpilot.operator.conditions import now_iso, set_condition
from kvpilot.operator.fanout import FanoutSettings, Target, initial_records, outcome, run_fanout, summarize
from kvpilot.operator.kube import ApiException, Kube

RESETS = "prefixcacheresets"
FLEETS = "inferencedeployments"
DONE = ("Succeeded", "Failed")
_MAX_FAILURE_EVENTS = 10  # one Event per failed pod, up to this many per reset


def _parse_time(s: str | None) -> float | None:
    if not s:
        return None
    return dt.datetime.fromisoformat(s.replace("Z", "+00:00")).timestamp()


def label_selector(sel: dict[str, Any]) -> str:
    """A LabelSelector as the string the list API takes."""
    parts = [f"{k}={v}" for k, v in sorted((sel.get("matchLabels") or {}).items())]
    for e in sel.get("matchExpressions") or []:
        op, key, vals = e["operator"], e["key"], ",".join(e.get("values") or [])
        parts.append({"In": f"{key} in ({vals})", "NotIn": f"{key} notin ({vals})", "Exists": key,
                      "DoesNotExist": f"!{key}"}[op])  # fmt: skip
    return ",".join(parts)


def pod_target(pod: dict[str, Any]) -> Target:
    meta, spec, st = pod["metadata"], pod.get("spec") or {}, pod.get("status") or {}
    ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in st.get("conditions") or [])
    reason = ""
    if meta.get("deletionTimestamp"):
        ready, reason = False, "pod is terminating"
    elif not ready:
        reason = f"pod not Ready (phase {st.get('phase')})"
    return Target(meta["name"], spec.get("nodeName", ""), st.get("podIP", ""), ready, reason)


class Resolved:
    def __init__(self, description: str, selector: str, port: int, token_ref: dict[str, Any] | None) -> None:
        self.description, self.selector, self.port, self.token_ref = description, selector, port, token_ref


async def resolve(kube: Kube, ns: str, spec: dict[str, Any]) -> Resolved:
    """What the reset is aimed at; raises kopf.PermanentError with a reason when the target is missing."""
    if spec.get("targetRef"):
        name = spec["targetRef"]["name"]
        fleet = await kube.get_cr(FLEETS, ns, name)
        if fleet is None:
            raise kopf.PermanentError(f"InferenceDeployment {ns}/{name} not found")
        fspec = fleet.get("spec") or {}
        port = spec.get("port") or fspec.get("port", 8000)
        return Resolved(f"InferenceDeployment/{name}", selector_string(name), int(port),
                        spec.get("adminTokenSecretRef") or fspec.get("adminTokenSecretRef"))  # fmt: skip
    sel = label_selector(spec["selector"])
    return Resolved(sel, sel, int(spec.get("port") or 8000), spec.get("adminTokenSecretRef"))


def _summary_status(records: list[dict[str, Any]]) -> dict[str, Any]:
    c = summarize(records)
    return {**c, "progress": f"{c['succeeded']}/{c['targets']}", "pods": records}


async def drive(kube: Kube, ns: str, name: str, logger: logging.Logger, stopped: Any = None) -> None:
    obj = await kube.get_cr(RESETS, ns, name)
    if obj is None:
        return
    status = obj.get("status") or {}
    if status.get("phase") not in DONE:
        obj = await _run(kube, obj, logger)
    if obj is not None:
        await _expire(kube, obj, logger, stopped)


async def _patch(kube: Kube, ns: str, name: str, status: dict[str, Any]) -> dict[str, Any]:
    metrics.STATUS_PATCHES.inc()
    return await kube.patch_status(RESETS, ns, name, status)


async def _run(kube: Kube, obj: dict[str, Any], logger: logging.Logger) -> dict[str, Any] | None:
    ns, name = obj["metadata"]["namespace"], obj["metadata"]["name"]
    spec, status = obj["spec"], obj.get("status") or {}
    gen = obj["metadata"].get("generation")
    try:
        target = await resolve(kube, ns, spec)
        token = None
        if target.token_ref:
            token = await kube.secret_value(
                ns, target.token_ref["name"], target.token_ref.get("key", "token")
            )
    except (kopf.PermanentError, KeyError, ApiException) as exc:
        reason = "TargetNotFound" if isinstance(exc, kopf.PermanentError) else "AdminTokenUnavailable"
        msg = str(exc) if not isinstance(exc, ApiException) else f"admin token Secret: {exc.reason}"
        return await _finish(
            kube, obj, status.get("pods") or [], "Failed", reason, msg, status.get("startTime")
        )

    running = {"phase": "Running", "target": target.description, "observedGeneration": gen}
    if status.get("phase") != "Running":
        # Resolve the targets once: pods that appear later are not part of this reset (like a Job's pods).
        # Nothing is written yet: the first write-ahead checkpoint (before any call) records the targets and
        # phase Running in one patch; a crash before it leaves nothing called and the reset starts over.
        t_list = time.monotonic()
        records = initial_records([pod_target(p) for p in await kube.list_pods(ns, target.selector)])
        logger.info("reset %s/%s: listed %d pods in %.3fs", ns, name, len(records), time.monotonic() - t_list)
        start = now_iso()
        kopf.event(obj, type="Normal", reason="Started",
                   message=f"resetting the prefix caches of {len(records)} pods of {target.description}")  # fmt: skip
    else:
        records = [dict(r) for r in status.get("pods") or []]
        start = status["startTime"]
        logger.info("reset %s/%s: resuming from status", ns, name)
    running["startTime"] = start

    started_at = _parse_time(start) or time.time()
    deadline = time.monotonic() + spec.get("timeoutSeconds", 60) - (time.time() - started_at)
    settings = FanoutSettings(
        engine=spec.get("engine", "kvpilot"), port=target.port, token=token,
        reset_running_requests=bool(spec.get("resetRunningRequests")),
        timeout_s=float(spec.get("timeoutSeconds", 60)),
        request_timeout_s=float(spec.get("requestTimeoutSeconds", 10)),
        max_concurrency=int(spec.get("maxConcurrency", 64)), backoff_limit=int(spec.get("backoffLimit", 3)),
    )  # fmt: skip

    async def checkpoint(recs: list[dict[str, Any]]) -> None:
        await _patch(kube, ns, name, {**running, **_summary_status(recs)})

    async def pod_gone(pod_name: str) -> str | None:
        pod = await kube.get_pod(ns, pod_name)
        if pod is None:
            return "pod deleted during the reset"
        if pod.metadata.deletion_timestamp is not None:
            return "pod terminating during the reset"
        return None

    t_calls = time.monotonic()
    records = await run_fanout(records, settings, deadline, checkpoint, pod_gone)
    phase, reason, message = outcome(records)
    logger.info("reset %s/%s: %s after %.3fs of calls", ns, name, message, time.monotonic() - t_calls)
    for r in [r for r in records if r["result"] == "Failed"][:_MAX_FAILURE_EVENTS]:
        kopf.event(
            obj, type="Warning", reason="PodResetFailed", message=f"{r['name']}: {r.get('message', '')}"
        )
    return await _finish(kube, obj, records, phase, reason, message, start)


async def _finish(kube: Kube, obj: dict[str, Any], records: list[dict[str, Any]], phase: str, reason: str,
                  message: str, start: str | None) -> dict[str, Any]:  # fmt: skip
    ns, name = obj["metadata"]["namespace"], obj["metadata"]["name"]
    gen = obj["metadata"].get("generation")
    conds = (obj.get("status") or {}).get("conditions")
    conds = set_condition(conds, "Complete" if phase == "Succeeded" else "Failed", True, reason, message, gen)
    end = now_iso()
    new = await _patch(kube, ns, name, {"phase": phase, "completionTime": end, "startTime": start or end,
                                        "conditions": conds, "observedGeneration": gen,
                                        **_summary_status(records)})  # fmt: skip
    kopf.event(obj, type="Normal" if phase == "Succeeded" else "Warning", reason=phase, message=message)
    metrics.RESETS.labels(ns, phase).inc()
    if start and (t0 := _parse_time(start)) is not None:
        metrics.RESET_DURATION.observe(max(0.0, time.time() - t0))
    metrics.record_reset_pods(ns, name, summarize(records))
    target = (obj["spec"].get("targetRef") or {}).get("name")
    if target:
        try:
            await kube.patch_status(
                FLEETS, ns, target, {"lastReset": {"name": name, "time": end, "result": phase}}
            )
        except ApiException as exc:
            if exc.status != 404:
                raise
    return new


async def _expire(kube: Kube, obj: dict[str, Any], logger: logging.Logger, stopped: Any) -> None:
    """ttlSecondsAfterFinished: delete the finished resource when its time is up (also after a restart)."""
    ttl = obj["spec"].get("ttlSecondsAfterFinished")
    done_at = _parse_time((obj.get("status") or {}).get("completionTime"))
    if ttl is None or done_at is None:
        return
    while (left := done_at + ttl - time.time()) > 0:
        if stopped is not None and stopped:
            return
        await asyncio.sleep(min(left, 1.0))
    logger.info("deleting %s: ttlSecondsAfterFinished %ss passed", obj["metadata"]["name"], ttl)
    await kube.delete_cr(
        RESETS, obj["metadata"]["namespace"], obj["metadata"]["name"], obj["metadata"]["uid"]
    )
