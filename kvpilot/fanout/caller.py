"""The fan-out itself: call every target's reset endpoint until each has a final result.

- A sliding window: `max_concurrency` workers take the next target as soon as one finishes, so one slow pod
  delays nobody else. An optional `limiter` (a semaphore shared by all fan-outs of a process) caps the calls
  in flight across them.
- Retries: transient failures (no connection, timeout, 5xx, 408/429) up to `retries_per_pod` times, busy
  answers (SGLang's 400 while requests run) until the deadline; both with exponential backoff and jitter.
- Every target ends with a final result by `deadline`; a `stop` event ends the fan-out early: no new calls
  start and calls in flight get `shutdown_grace_s` to finish, the others are left Pending (in doubt).
- The caller's hooks, all optional: `pod_gone(target)` is asked before every call (so a token never goes to
  an address that no longer belongs to the target) and says why the target no longer counts, or None;
  `checkpoint(results)` receives progress at most once per `progress_interval_s`, best effort (its errors
  never stop the fan-out); `on_call(verdict, code)` hears of every call, for the caller's own metrics.
- A reply is read up to MAX_REPLY_BYTES and judged from that; what of it may be reported is redact.py's rule.
- Calls go through `http1.Pool`: one connection per pod, kept alive for its retries (and never used for
  another pod), at most a window's worth of them idle; a token that is not a valid header value is never
  sent (every target Failed).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Sequence

from kvpilot.fanout.backoff import backoff_delay
from kvpilot.fanout.engines import Engine, Judgement, Verdict, engine_for
from kvpilot.fanout.http1 import Endpoint, Pool, ReplyError, endpoint, header_value_ok
from kvpilot.fanout.redact import reported
from kvpilot.fanout.results import PodResult, initial_results
from kvpilot.fanout.targets import FanoutSettings, Target, address

log = logging.getLogger(__name__)

# checkpoint(results): progress for people (kubectl get, kvpilot reset --wait); best effort.
Checkpoint = Callable[[list[PodResult]], Awaitable[None]]
# pod_gone(target) -> why the target no longer counts (deleted, replaced, new IP), or None while it is there.
PodGone = Callable[[Target], Awaitable[str | None]]
# on_call(verdict, code): one per call made, with its Verdict value and the HTTP status as text ("0": no
# reply); once more with ("Failed", "deadline") for a target whose deadline passed before its next call.
OnCall = Callable[[str, str], None]


def _decide(res: PodResult, result: str, message: str, started: float, j: Judgement | None = None) -> None:
    res.result, res.message = result, message
    res.duration_s = round(time.monotonic() - started, 4)
    if j is not None:
        res.epoch, res.evicted_blocks = j.epoch, j.evicted_blocks
        res.ranks = list(j.ranks) if j.ranks is not None else None


async def _call(
    pool: Pool, engine: Engine, ep: Endpoint, timeout: float, token: str | None
) -> tuple[int, Judgement]:
    """One reset call: (HTTP status or 0, verdict)."""
    try:
        async with asyncio.timeout(timeout):
            status, body = await pool.request(ep)
    except TimeoutError:
        return 0, Judgement(Verdict.TRANSIENT, f"no reply within {timeout:.1f}s")
    except OSError as exc:
        return 0, Judgement(Verdict.TRANSIENT, f"cannot connect: {exc}")
    except ReplyError as exc:
        # a broken reply's message quotes the pod's first bytes: redacted like any reply text
        return 0, Judgement(Verdict.TRANSIENT, reported(str(exc), (token,)))
    return status, engine.judge(status, body.decode("utf-8", "replace"), token)


async def _reset_one(
    pool: Pool,
    res: PodResult,
    settings: FanoutSettings,
    deadline: float,
    pod_gone: PodGone | None,
    limiter: asyncio.Semaphore | None,
    on_call: OnCall,
) -> None:
    """Call one target until it has a final result; `res` is updated in place."""
    assert res.target is not None
    engine = engine_for(settings.engine)
    started = time.monotonic()
    # The request is prepared once per target; its connection is kept per pod (http1.Pool).
    host, port, tls, prefix = address(res.target, settings)
    path = prefix + engine.path(settings.reset_running_requests)
    ep = endpoint(res.target.uid or res.target.name, host, port, tls, path, engine.method, settings.token)
    transient = busy = 0
    last = ""
    while True:
        if pod_gone is not None and (reason := await pod_gone(res.target)):
            _decide(res, "Skipped", reason, started)
            return
        remaining = deadline - time.monotonic()
        if remaining <= 0.01:
            why = f"; last: {last}" if last else ""
            _decide(res, "Failed", f"not reset within timeoutSeconds ({settings.timeout_s:g}s){why}", started)
            on_call(Verdict.FAILED.value, "deadline")
            return
        res.attempts += 1
        async with limiter or contextlib.nullcontext():
            status, j = await _call(
                pool, engine, ep, min(settings.request_timeout_s, remaining), settings.token
            )
        res.http_status = status
        on_call(j.verdict.value, str(status))
        if j.verdict is Verdict.SUCCEEDED:
            _decide(res, "Succeeded", j.message, started, j)
            return
        if j.verdict is Verdict.NOT_SUPPORTED:
            _decide(res, "NotSupported", j.message, started)
            return
        if j.verdict is Verdict.FAILED:
            _decide(res, "Failed", j.message, started)
            return
        last = j.message
        if j.verdict is Verdict.TRANSIENT:
            transient += 1
            if transient > settings.retries_per_pod:
                gave_up = f"gave up after {res.attempts} attempts, retriesPerPod {settings.retries_per_pod}"
                _decide(res, "Failed", f"{last} ({gave_up})", started)
                return
        else:
            busy += 1
        n = transient if j.verdict is Verdict.TRANSIENT else busy
        delay = backoff_delay(n, settings.backoff_base_s, settings.backoff_max_s)
        await asyncio.sleep(max(0.0, min(delay, deadline - time.monotonic())))


def _ignore_call(verdict: str, code: str) -> None:
    pass


async def run_fanout(
    targets: Sequence[Target],
    settings: FanoutSettings,
    *,
    deadline: float | None = None,
    checkpoint: Checkpoint | None = None,
    pod_gone: PodGone | None = None,
    limiter: asyncio.Semaphore | None = None,
    stop: asyncio.Event | None = None,
    on_call: OnCall | None = None,
) -> list[PodResult]:
    """Reset every target; one result per target, sorted by name, all final unless `stop` was set (then the
    targets not decided within the shutdown grace stay Pending). `deadline` is a time.monotonic() value
    (default: now + settings.timeout_s)."""
    results = initial_results(targets)
    deadline = deadline if deadline is not None else time.monotonic() + settings.timeout_s
    queue: asyncio.Queue[PodResult] = asyncio.Queue()
    for res in results:
        if res.result == "Pending":
            queue.put_nowait(res)
    if queue.empty():
        return results
    if settings.token and not header_value_ok(settings.token):
        for res in results:
            if res.result == "Pending":
                res.result = "Failed"
                res.message = (
                    "the admin token is not a valid HTTP header value (a line break or control character)"
                )
        return results
    stop = stop or asyncio.Event()
    on_call = on_call or _ignore_call
    # Idle connections for the window's worth of pods: a pod is called again only on a retry.
    pool = Pool(max_idle=settings.max_concurrency)

    async def worker() -> None:
        while not stop.is_set():
            try:
                res = queue.get_nowait()
            except asyncio.QueueEmpty:
                return
            await _reset_one(pool, res, settings, deadline, pod_gone, limiter, on_call)

    async def progress() -> None:
        while True:
            await asyncio.sleep(settings.progress_interval_s)
            try:
                await checkpoint(results)  # type: ignore[misc]
            except Exception as exc:  # noqa: BLE001 - progress is best effort
                log.warning("progress checkpoint failed (the fan-out goes on): %s", exc)

    workers = [asyncio.create_task(worker()) for _ in range(min(settings.max_concurrency, queue.qsize()))]
    stopping = asyncio.create_task(stop.wait())
    helpers = [stopping]
    if checkpoint is not None:
        helpers.append(asyncio.create_task(progress()))
    all_done = asyncio.gather(*workers)
    try:
        # Slack past the deadline: each call is already bounded by it; this only guards against a stall.
        slack = max(0.0, deadline - time.monotonic()) + 2.0
        done, _ = await asyncio.wait([stopping, all_done], return_when=asyncio.FIRST_COMPLETED, timeout=slack)
        if stopping in done:  # shutting down: calls in flight get a bounded grace
            await asyncio.wait(workers, timeout=settings.shutdown_grace_s)
    finally:
        for t in [*workers, *helpers]:
            t.cancel()
        await asyncio.gather(*helpers, return_exceptions=True)
        pool.close()  # calls abandoned after the grace end here too
        with contextlib.suppress(asyncio.CancelledError):
            await all_done  # a worker's own error (a bug) surfaces here
    if not stop.is_set():
        for res in results:
            if res.result == "Pending":
                res.result = "Failed"
                res.message = f"not reset within timeoutSeconds ({settings.timeout_s:g}s)"
    return results
