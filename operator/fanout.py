"""Fan a prefix-cache reset out to pods: who is called, how often, and what each pod's result is.

Crash safety (each pod is reset at most once per PrefixCacheReset, also across operator restarts): pods are
called in a few waves; before a wave is called its pods are recorded as `Dispatched` in status (one patch for
the whole wave) together with the cache epoch each pod reported just before (`epochBefore`, kvpilot engine).
A restarted operator finds those records: a pod whose epoch has moved past `epochBefore` was reset (by the
call in flight when the operator died) and counts as Succeeded; one whose epoch has not moved was not, and is
called. Without an epoch to compare (vLLM, SGLang) an in-flight pod is reported Failed, outcome unknown,
rather than risk a second reset. Results reach status at wave ends and at most once per progress interval, so
1000 pods take a handful of patches, not 1000.
"""

from __future__ import annotations

import asyncio
import math
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import aiohttp

from kvpilot.operator import metrics
from kvpilot.operator.engines import Engine, Judgement, Verdict, engine_for

FINAL = ("Succeeded", "Failed", "Skipped", "NotSupported")

# checkpoint(records, final): persist status.pods; it must raise if the write failed (write-ahead).
Checkpoint = Callable[[list[dict[str, Any]]], Awaitable[None]]
# pod_gone(name) -> why the pod no longer counts (deleted, terminating), or None while it is there.
PodGone = Callable[[str], Awaitable[str | None]]


@dataclass(frozen=True, slots=True)
class Target:
    """A pod as resolved when the reset starts."""

    name: str
    node: str = ""
    ip: str = ""
    ready: bool = True
    reason: str = ""  # why it is not ready, when it is not


@dataclass(frozen=True, slots=True)
class FanoutSettings:
    engine: str = "kvpilot"
    port: int = 8000
    token: str | None = None
    reset_running_requests: bool = False
    timeout_s: float = 60.0
    request_timeout_s: float = 10.0
    max_concurrency: int = 64
    backoff_limit: int = 3
    backoff_base_s: float = 0.2
    backoff_max_s: float = 5.0
    progress_interval_s: float = 1.0
    # Write-ahead patches (plus one per progress interval). None: 1 for engines that report an epoch (a
    # restart then decides every in-flight pod exactly, so one patch suffices), 8 for the others (which bounds
    # the pods whose outcome a crash leaves unknown to about an eighth).
    waves: int | None = None


def initial_records(targets: list[Target]) -> list[dict[str, Any]]:
    """status.pods at the start: pods that are not Ready (or have no IP) are Skipped without a call."""
    out = []
    for t in sorted(targets, key=lambda t: t.name):
        rec: dict[str, Any] = {"name": t.name, "node": t.node, "ip": t.ip, "attempts": 0}
        if not t.ready or not t.ip:
            rec.update(
                result="Skipped", message=t.reason or ("pod has no IP" if not t.ip else "pod not Ready")
            )
        else:
            rec["result"] = "Pending"
        out.append(rec)
    return out


def summarize(records: list[dict[str, Any]]) -> dict[str, int]:
    counts = {"targets": len(records), "succeeded": 0, "failed": 0, "skipped": 0, "notSupported": 0}
    key = {"Succeeded": "succeeded", "Failed": "failed", "Skipped": "skipped", "NotSupported": "notSupported"}
    for r in records:
        if r.get("result") in key:
            counts[key[r["result"]]] += 1
    return counts


def outcome(records: list[dict[str, Any]]) -> tuple[str, str, str]:
    """(phase, reason, message) once every pod has a final result. A pod that could not be reset (Failed or
    NotSupported) fails the whole reset: its cache still holds pre-reset KV. Skipped pods serve no traffic."""
    c = summarize(records)
    detail = (
        f"{c['succeeded']}/{c['targets']} pods reset, {c['failed']} failed, {c['skipped']} skipped, "
        f"{c['notSupported']} not supported"
    )
    if c["failed"]:
        bad = [r for r in records if r.get("result") == "Failed"]
        first = bad[0]
        return "Failed", "PodsFailed", f"{detail}; {first['name']}: {first.get('message', '')}"
    if c["notSupported"]:
        return "Failed", "ResetNotSupported", detail
    return "Succeeded", "AllPodsReset" if c["targets"] else "NoTargets", detail


def _url(rec: dict[str, Any], settings: FanoutSettings, path: str) -> str:
    host = rec["ip"]
    if ":" in host:  # IPv6
        host = f"[{host}]"
    return f"http://{host}:{settings.port}{path}"


def _headers(settings: FanoutSettings) -> dict[str, str]:
    return {"Authorization": f"Bearer {settings.token}"} if settings.token else {}


async def read_epoch(session: aiohttp.ClientSession, rec: dict[str, Any], settings: FanoutSettings,
                     engine: Engine, timeout: float) -> int | None:  # fmt: skip
    """The pod's cache epoch from its stats endpoint, or None if it cannot be read."""
    if engine.epoch_path is None:
        return None
    try:
        async with session.get(
            _url(rec, settings, engine.epoch_path), timeout=aiohttp.ClientTimeout(total=timeout)
        ) as resp:
            if resp.status != 200:
                return None
            body = await resp.json(content_type=None)
    except (TimeoutError, aiohttp.ClientError, ValueError):
        return None
    epoch = body.get("epoch") if isinstance(body, dict) else None
    return epoch if isinstance(epoch, int) else None


def _finish(
    rec: dict[str, Any], result: str, message: str, started: float, j: Judgement | None = None
) -> None:
    rec["result"] = result
    rec["message"] = message
    rec["durationSeconds"] = round(time.monotonic() - started, 4)
    if j is not None and j.epoch is not None:
        rec["epoch"] = j.epoch
    if j is not None and j.evicted_blocks is not None:
        rec["evictedBlocks"] = j.evicted_blocks


async def reset_pod(
    session: aiohttp.ClientSession,
    rec: dict[str, Any],
    settings: FanoutSettings,
    deadline: float,
    pod_gone: PodGone | None = None,
) -> None:
    """Call one pod until it has a final result; `rec` (its status entry) is updated in place."""
    engine = engine_for(settings.engine)
    started = time.monotonic()
    url = _url(rec, settings, engine.path(settings.reset_running_requests))
    transient = 0
    last = ""
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0.01:
            why = f"; last: {last}" if last else ""
            _finish(rec, "Failed", f"not reset within timeoutSeconds ({settings.timeout_s:g}s){why}", started)
            metrics.POD_REQUESTS.labels("Failed", "deadline").inc()
            return
        rec["attempts"] = int(rec.get("attempts", 0)) + 1
        status = 0
        maybe_applied = False  # the request may have reached the pod and reset it
        t = min(settings.request_timeout_s, remaining)
        try:
            async with session.request(
                engine.method, url, headers=_headers(settings), timeout=aiohttp.ClientTimeout(total=t)
            ) as resp:
                status = resp.status
                text = await resp.text()
            j = engine.judge(status, text)
        except TimeoutError:
            j, maybe_applied = Judgement(Verdict.TRANSIENT, f"no reply within {t:.1f}s"), True
        except aiohttp.ClientConnectorError as exc:  # never reached the pod: safe to retry
            j = Judgement(Verdict.TRANSIENT, f"cannot connect: {exc.os_error or exc}")
        except aiohttp.ClientError as exc:
            j, maybe_applied = Judgement(Verdict.TRANSIENT, f"{type(exc).__name__}: {exc}"), True
        rec["httpStatus"] = status
        metrics.POD_REQUESTS.labels(j.verdict.value, str(status)).inc()
        if j.verdict in (Verdict.TRANSIENT, Verdict.BUSY) and time.monotonic() >= deadline - 0.01:
            # The call was cut short by the overall deadline: report that, with what the pod last said.
            why = "; ".join(x for x in (last, j.message) if x)
            _finish(
                rec,
                "Failed",
                f"not reset within timeoutSeconds ({settings.timeout_s:g}s); last: {why}",
                started,
            )
            return
        if j.verdict is Verdict.SUCCEEDED:
            _finish(rec, "Succeeded", j.message, started, j)
            return
        if j.verdict is Verdict.NOT_SUPPORTED:
            _finish(rec, "NotSupported", j.message, started)
            return
        if j.verdict is Verdict.FAILED:
            _finish(rec, "Failed", j.message, started)
            return
        last = j.message
        if maybe_applied and rec.get("epochBefore") is not None:
            # A timed-out or cut-off call may still have reset the pod: look before calling again.
            epoch = await read_epoch(session, rec, settings, engine, min(2.0, settings.request_timeout_s))
            if epoch is not None and epoch > rec["epochBefore"]:
                rec["epoch"] = epoch
                _finish(rec, "Succeeded", f"reset confirmed by epoch {epoch} after: {last}", started)
                return
        if status == 0 and pod_gone is not None:
            reason = await pod_gone(rec["name"])
            if reason:
                _finish(rec, "Skipped", reason, started)
                return
        if j.verdict is Verdict.TRANSIENT:
            transient += 1
            if transient > settings.backoff_limit:
                _finish(rec, "Failed", f"{last} (gave up after {rec['attempts']} attempts, backoffLimit "
                        f"{settings.backoff_limit})", started)  # fmt: skip
                return
        n = max(transient, 1)
        delay = min(settings.backoff_max_s, settings.backoff_base_s * 2 ** (n - 1)) * random.uniform(0.8, 1.2)
        await asyncio.sleep(max(0.0, min(delay, deadline - time.monotonic())))


async def resolve_in_doubt(
    session: aiohttp.ClientSession,
    records: list[dict[str, Any]],
    settings: FanoutSettings,
    pod_gone: PodGone | None = None,
) -> None:
    """After a restart: decide the pods whose call may have been in flight (result Dispatched)."""
    engine = engine_for(settings.engine)
    for rec in records:
        if rec.get("result") != "Dispatched":
            continue
        before = rec.get("epochBefore")
        if engine.epoch_path is None or before is None:
            rec["result"] = "Failed"
            rec["message"] = ("outcome unknown: a reset call was in flight when the operator restarted and this "
                              "engine reports no epoch to check; not called again so it is never reset twice")  # fmt: skip
            continue
        epoch = await read_epoch(session, rec, settings, engine, settings.request_timeout_s)
        if epoch is not None and epoch > before:
            rec.update(result="Succeeded", epoch=epoch,
                       message=f"reset confirmed after an operator restart: epoch {before} -> {epoch}")  # fmt: skip
        elif epoch is not None:
            rec["result"] = "Pending"  # provably not reset since epochBefore: safe to call
        else:
            reason = await pod_gone(rec["name"]) if pod_gone else None
            rec["result"] = "Skipped" if reason else "Failed"
            rec["message"] = (
                reason or "outcome unknown: in flight when the operator restarted, epoch unreadable now"
            )


async def run_fanout(
    records: list[dict[str, Any]],
    settings: FanoutSettings,
    deadline: float,
    checkpoint: Checkpoint,
    pod_gone: PodGone | None = None,
) -> list[dict[str, Any]]:
    """Reset every Pending pod in `records` (resuming Dispatched ones) and return `records`, all final."""
    engine = engine_for(settings.engine)
    # Keep-alive: a pod's epoch probe and its reset call share one connection.
    connector = aiohttp.TCPConnector(limit=settings.max_concurrency + 8)
    async with aiohttp.ClientSession(connector=connector) as session:
        await resolve_in_doubt(session, records, settings, pod_gone)
        pending = [r for r in records if r.get("result") == "Pending"]
        waves = settings.waves or (1 if engine.epoch_path is not None else 8)
        size = max(settings.max_concurrency, math.ceil(len(pending) / waves))
        sem = asyncio.Semaphore(settings.max_concurrency)

        async def limited(coro_fn, *args):  # noqa: ANN001, ANN202
            async with sem:
                return await coro_fn(*args)

        for i in range(0, len(pending), size):
            wave = pending[i : i + size]
            if time.monotonic() >= deadline:
                for rec in wave:
                    rec.update(result="Failed", message=f"timeoutSeconds ({settings.timeout_s:g}s) passed before "
                               "this pod was called")  # fmt: skip
                continue
            if engine.epoch_path is not None:
                probe_t = min(2.0, settings.request_timeout_s)
                epochs = await asyncio.gather(
                    *(limited(read_epoch, session, r, settings, engine, probe_t) for r in wave)
                )
                for rec, epoch in zip(wave, epochs):
                    if epoch is not None:
                        rec["epochBefore"] = epoch
            for rec in wave:
                rec["result"] = "Dispatched"
            await checkpoint(records)  # write-ahead: raises, and nothing is called, if it was not recorded

            done = asyncio.Event()

            async def progress(done: asyncio.Event) -> None:
                # Live progress for `kubectl get pcr` / `kvpilot reset --wait`, at a bounded patch rate.
                while not done.is_set():
                    try:
                        await asyncio.wait_for(done.wait(), settings.progress_interval_s)
                    except TimeoutError:
                        await checkpoint(records)

            flusher = asyncio.create_task(progress(done))
            try:
                await asyncio.gather(
                    *(limited(reset_pod, session, r, settings, deadline, pod_gone) for r in wave)
                )
            finally:
                done.set()
                await flusher
    return records
