"""Reset the prefix caches of a list of targets over HTTP: who is called, how often, with what result.

Kubernetes-free and kopf-free: the operator (resets.py) and the fleet router both call `run_fanout` with
targets (name plus IP or base URL) and settings, and get one `PodRecord` per target back.

- A sliding window: `max_concurrency` workers take the next target as soon as one finishes, so one slow pod
  delays nobody else. An optional `limiter` (a semaphore shared by all resets of a process) caps the calls
  in flight across them.
- Retries: transient failures (no connection, timeout, 5xx, 408/429) up to `retries_per_pod` times, busy
  answers (SGLang's 400 while requests run) until the deadline; both with exponential backoff and jitter.
- Every target ends with a final result by `deadline`; a `stop` event ends the fan-out early: no new calls
  start and calls in flight get `shutdown_grace_s` to finish, the others are left `Pending` (in doubt).
- `pod_gone(target)` is asked before every call (so a token never goes to an address that no longer belongs
  to the target) and says why the target no longer counts, or None; `checkpoint(records)` receives progress
  at most once per `progress_interval_s`, best effort (its errors never stop the fan-out).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from kvpilot.operator import metrics
from kvpilot.operator.engines import Engine, Judgement, Verdict, engine_for

log = logging.getLogger(__name__)

FINAL = ("Succeeded", "Failed", "Skipped", "NotSupported")


@dataclass(frozen=True, slots=True)
class Target:
    """One endpoint to reset: a pod as resolved when the reset starts, or any URL."""

    name: str
    ip: str = ""
    node: str = ""
    uid: str = ""
    url: str = ""  # base URL (scheme://host:port); empty: settings.scheme://ip:settings.port
    skip_reason: str = ""  # non-empty: not called, reported Skipped with this reason


@dataclass(frozen=True, slots=True)
class FanoutSettings:
    engine: str = "kvpilot"
    port: int = 8000
    scheme: str = "http"
    token: str | None = None
    ca_file: str | None = None  # CA bundle that signs the targets' certificates (scheme https)
    reset_running_requests: bool = False
    timeout_s: float = 60.0
    request_timeout_s: float = 10.0
    max_concurrency: int = 64
    retries_per_pod: int = 3
    backoff_base_s: float = 0.2
    backoff_max_s: float = 5.0
    progress_interval_s: float = 1.0
    shutdown_grace_s: float = 5.0


@dataclass(slots=True)
class PodRecord:
    """The result of one target; `result` is Pending until it is final."""

    name: str
    node: str = ""
    ip: str = ""
    result: str = "Pending"
    http_status: int | None = None
    attempts: int = 0
    epoch: int | None = None
    evicted_blocks: int | None = None
    message: str = ""
    duration_s: float | None = None
    ranks: list[dict[str, Any]] | None = None  # per data-parallel rank, as the pod answered
    target: Target | None = field(default=None, repr=False, compare=False)

    def as_status(self) -> dict[str, Any]:
        """The camelCase entry of PrefixCacheReset status.pods (empty fields left out)."""
        out: dict[str, Any] = {"name": self.name, "result": self.result, "attempts": self.attempts}
        for key, value in (("node", self.node), ("ip", self.ip), ("httpStatus", self.http_status),
                           ("epoch", self.epoch), ("evictedBlocks", self.evicted_blocks),
                           ("message", self.message), ("durationSeconds", self.duration_s),
                           ("ranks", self.ranks)):  # fmt: skip
            if value not in (None, ""):
                out[key] = value
        return out


# checkpoint(records): progress for people (kubectl get, kvpilot reset --wait); best effort.
Checkpoint = Callable[[list[PodRecord]], Awaitable[None]]
# pod_gone(target) -> why the target no longer counts (deleted, replaced, new IP), or None while it is there.
PodGone = Callable[[Target], Awaitable[str | None]]


def initial_records(targets: Sequence[Target]) -> list[PodRecord]:
    """One record per target, sorted by name; targets with a skip reason (or no address) are Skipped."""
    out = []
    for t in sorted(targets, key=lambda t: t.name):
        rec = PodRecord(t.name, t.node, t.ip, target=t)
        if t.skip_reason or not (t.ip or t.url):
            rec.result, rec.message = "Skipped", t.skip_reason or "no IP"
        out.append(rec)
    return out


def summarize(records: Sequence[PodRecord]) -> dict[str, int]:
    counts = {"targets": len(records), "succeeded": 0, "failed": 0, "skipped": 0, "notSupported": 0,
              "pending": 0}  # fmt: skip
    key = {"Succeeded": "succeeded", "Failed": "failed", "Skipped": "skipped", "NotSupported": "notSupported"}
    for r in records:
        counts[key.get(r.result, "pending")] += 1
    return counts


def base_url(t: Target, settings: FanoutSettings) -> str:
    if t.url:
        return t.url.rstrip("/")
    host = f"[{t.ip}]" if ":" in t.ip else t.ip  # IPv6
    return f"{settings.scheme}://{host}:{settings.port}"


def _headers(settings: FanoutSettings) -> dict[str, str]:
    return {"Authorization": f"Bearer {settings.token}"} if settings.token else {}


def _backoff(settings: FanoutSettings, n: int) -> float:
    """Exponential backoff with jitter: the n-th wait is between half and all of base * 2**(n-1)."""
    cap = min(settings.backoff_max_s, settings.backoff_base_s * 2 ** max(n - 1, 0))
    return cap * random.uniform(0.5, 1.0)


def _decide(rec: PodRecord, result: str, message: str, started: float, j: Judgement | None = None) -> None:
    rec.result, rec.message = result, message
    rec.duration_s = round(time.monotonic() - started, 4)
    if j is not None:
        rec.epoch, rec.evicted_blocks = j.epoch, j.evicted_blocks
        rec.ranks = list(j.ranks) if j.ranks is not None else None


async def _call(
    session: aiohttp.ClientSession, engine: Engine, url: str, settings: FanoutSettings, timeout: float
) -> tuple[int, Judgement]:
    """One reset call: (HTTP status or 0, verdict)."""
    try:
        async with session.request(
            engine.method, url, headers=_headers(settings), timeout=aiohttp.ClientTimeout(total=timeout)
        ) as resp:
            return resp.status, engine.judge(resp.status, await resp.text())
    except TimeoutError:
        return 0, Judgement(Verdict.TRANSIENT, f"no reply within {timeout:.1f}s")
    except aiohttp.ClientConnectorError as exc:
        return 0, Judgement(Verdict.TRANSIENT, f"cannot connect: {exc.os_error or exc}")
    except aiohttp.ClientError as exc:
        return 0, Judgement(Verdict.TRANSIENT, f"{type(exc).__name__}: {exc}")


async def reset_pod(
    session: aiohttp.ClientSession,
    rec: PodRecord,
    settings: FanoutSettings,
    deadline: float,
    pod_gone: PodGone | None = None,
    limiter: asyncio.Semaphore | None = None,
) -> None:
    """Call one target until it has a final result; `rec` is updated in place."""
    assert rec.target is not None
    engine = engine_for(settings.engine)
    started = time.monotonic()
    url = base_url(rec.target, settings) + engine.path(settings.reset_running_requests)
    transient = busy = 0
    last = ""
    while True:
        if pod_gone is not None and (reason := await pod_gone(rec.target)):
            _decide(rec, "Skipped", reason, started)
            return
        remaining = deadline - time.monotonic()
        if remaining <= 0.01:
            why = f"; last: {last}" if last else ""
            _decide(rec, "Failed", f"not reset within timeoutSeconds ({settings.timeout_s:g}s){why}", started)
            metrics.POD_REQUESTS.labels("Failed", "deadline").inc()
            return
        rec.attempts += 1
        async with limiter or contextlib.nullcontext():
            status, j = await _call(
                session, engine, url, settings, min(settings.request_timeout_s, remaining)
            )
        rec.http_status = status
        metrics.POD_REQUESTS.labels(j.verdict.value, str(status)).inc()
        if j.verdict is Verdict.SUCCEEDED:
            _decide(rec, "Succeeded", j.message, started, j)
            return
        if j.verdict is Verdict.NOT_SUPPORTED:
            _decide(rec, "NotSupported", j.message, started)
            return
        if j.verdict is Verdict.FAILED:
            _decide(rec, "Failed", j.message, started)
            return
        last = j.message
        if j.verdict is Verdict.TRANSIENT:
            transient += 1
            if transient > settings.retries_per_pod:
                _decide(rec, "Failed", f"{last} (gave up after {rec.attempts} attempts, retriesPerPod "
                        f"{settings.retries_per_pod})", started)  # fmt: skip
                return
        else:
            busy += 1
        delay = _backoff(settings, transient if j.verdict is Verdict.TRANSIENT else busy)
        await asyncio.sleep(max(0.0, min(delay, deadline - time.monotonic())))


async def run_fanout(
    records: Sequence[PodRecord] | Sequence[Target],
    settings: FanoutSettings,
    deadline: float | None = None,
    checkpoint: Checkpoint | None = None,
    pod_gone: PodGone | None = None,
    limiter: asyncio.Semaphore | None = None,
    stop: asyncio.Event | None = None,
) -> list[PodRecord]:
    """Reset every Pending record's target (targets are made records first); return the records, all final
    unless `stop` was set (then the targets not decided within the shutdown grace stay Pending)."""
    if records and isinstance(records[0], Target):
        records = initial_records(records)  # type: ignore[arg-type]
    records = list(records)  # type: ignore[arg-type]
    deadline = deadline if deadline is not None else time.monotonic() + settings.timeout_s
    queue: asyncio.Queue[PodRecord] = asyncio.Queue()
    for rec in records:
        if rec.result == "Pending":
            queue.put_nowait(rec)
    if queue.empty():
        return records
    stop = stop or asyncio.Event()
    ssl: Any = None
    if settings.ca_file:
        import ssl as ssl_mod

        ssl = ssl_mod.create_default_context(cafile=settings.ca_file)
    connector = aiohttp.TCPConnector(limit=settings.max_concurrency + 8, ssl=ssl if ssl is not None else True)

    async with aiohttp.ClientSession(connector=connector) as session:

        async def worker() -> None:
            while not stop.is_set():
                try:
                    rec = queue.get_nowait()
                except asyncio.QueueEmpty:
                    return
                await reset_pod(session, rec, settings, deadline, pod_gone, limiter)

        async def progress() -> None:
            while True:
                await asyncio.sleep(settings.progress_interval_s)
                try:
                    await checkpoint(records)  # type: ignore[misc]
                except Exception as exc:  # noqa: BLE001 - progress is best effort
                    log.warning("progress checkpoint failed (the fan-out goes on): %s", exc)

        workers = [asyncio.create_task(worker()) for _ in range(min(settings.max_concurrency, queue.qsize()))]
        helpers = [asyncio.create_task(stop.wait())]
        if checkpoint is not None:
            helpers.append(asyncio.create_task(progress()))
        all_done = asyncio.gather(*workers)
        try:
            # Slack past the deadline: each call is already bounded by it; this only guards against a stall.
            done, _ = await asyncio.wait([helpers[0], all_done], return_when=asyncio.FIRST_COMPLETED,
                                         timeout=max(0.0, deadline - time.monotonic()) + 2.0)  # fmt: skip
            if helpers[0] in done:  # shutting down: calls in flight get a bounded grace
                await asyncio.wait(workers, timeout=settings.shutdown_grace_s)
        finally:
            for t in [*workers, *helpers]:
                t.cancel()
            await asyncio.gather(*helpers, return_exceptions=True)
            with contextlib.suppress(asyncio.CancelledError):
                await all_done  # a worker's own error (a bug) surfaces here
    if not stop.is_set():
        for rec in records:
            if rec.result == "Pending":
                rec.result = "Failed"
                rec.message = f"not reset within timeoutSeconds ({settings.timeout_s:g}s)"
    return records
