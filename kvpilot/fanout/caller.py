"""The fan-out itself: call every target's reset endpoint until each has a final result.

- A sliding window: `max_concurrency` workers take the next target as soon as one finishes, so one slow pod
  delays nobody else. An optional `limiter` (a semaphore shared by all fan-outs of a process) caps the calls
  in flight across them.
- Retries: transient failures (no connection, timeout, 5xx, 408/429) up to `retries_per_pod` times, busy
  answers (SGLang's 400 while requests run) until the deadline; both with exponential backoff and jitter.
- A target's reset is its engine's calls in order (engines.py: SGLang's HiCache storage clear after its
  flush), each retried until final; with `settings.verify`, a canary before and after proves the pod cold
  (verify.py), and a pod that answered success but still serves the canary from cache Fails, StillWarm.
- Every target ends with a final result by `deadline`; a `stop` event ends the fan-out early: no new calls
  start and calls in flight get `shutdown_grace_s` to finish, the others are left Pending (in doubt).
- The caller's hooks, all optional: `pod_gone(target)` is asked before every call (so a token never goes to
  an address that no longer belongs to the target) and says why the target no longer counts, or None;
  `pod_starting(target)` says the pod is still loading its model (never Ready since its engine started): it
  is waited for, before its first call and whenever it cannot be reached, never failed for it, and Skipped
  (reason Starting) if it still is at the deadline;
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
import json
import logging
import secrets
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from kvpilot.fanout import verify
from kvpilot.fanout.backoff import backoff_delay
from kvpilot.fanout.engines import Engine, Judgement, ResetCall, Verdict, engine_for
from kvpilot.fanout.http1 import Endpoint, Pool, ReplyError, endpoint, header_value_ok
from kvpilot.fanout.redact import reported
from kvpilot.fanout.results import STARTING, STILL_WARM, Outcome, PodResult, Verified, initial_results
from kvpilot.fanout.targets import CallSettings, ResetSettings, Target, address

log = logging.getLogger(__name__)

# checkpoint(results): progress for people (kubectl get, kvpilot reset --wait); best effort.
Checkpoint = Callable[[list[PodResult]], Awaitable[None]]
# pod_gone(target) -> why the target no longer counts (deleted, replaced, new IP), or None while it is there.
PodGone = Callable[[Target], Awaitable[str | None]]
# pod_starting(target) -> whether the pod is still starting (it holds nothing yet: waited for, not failed).
PodStarting = Callable[[Target], Awaitable[bool]]
# How often a starting pod is looked at again (answered from the caller's memory: its pod watch).
STARTING_POLL_S = 0.5
# on_call(verdict, code): one per call made, with its Verdict value and the HTTP status as text ("0": no
# reply); once more with ("Failed", "deadline") for a target whose deadline passed before its next call.
OnCall = Callable[[str, str], None]


def decide(res: PodResult, result: Outcome, message: str, started: float, j: Judgement | None = None) -> None:
    res.result, res.message = result, message
    res.duration_s = round(time.monotonic() - started, 4)
    if j is not None:
        res.epoch, res.evicted_blocks = j.epoch, j.evicted_blocks
        res.ranks = list(j.ranks) if j.ranks is not None else None


async def _send(pool: Pool, ep: Endpoint, timeout: float, token: str | None) -> tuple[int, str]:
    """One request: (HTTP status, reply text), or (0, why there is no reply)."""
    try:
        async with asyncio.timeout(timeout):
            status, body = await pool.request(ep)
    except TimeoutError:
        return 0, f"no reply within {timeout:.1f}s"
    except OSError as exc:
        return 0, f"cannot connect: {exc}"
    except ReplyError as exc:
        # a broken reply's message quotes the pod's first bytes: redacted like any reply text
        return 0, reported(str(exc), (token,))
    return status, body.decode("utf-8", "replace")


class Gone(Exception):
    """pod_gone said the target no longer counts (deleted, replaced, new IP): it is Skipped."""


class StillStarting(Exception):
    """The pod was still starting at the deadline: it is Skipped, reason STARTING."""


class Pod:
    """One target's calls: its address, the fan-out's pool, limiter, deadline and pod_gone check (a reset's,
    here; a warm-up's, warmup.py)."""

    def __init__(
        self,
        pool: Pool,
        res: PodResult,
        settings: CallSettings,
        deadline: float,
        limiter: asyncio.Semaphore | None,
        pod_gone: PodGone | None,
        pod_starting: PodStarting | None,
    ) -> None:
        assert res.target is not None
        self.pool, self.settings, self.deadline, self.limiter = pool, settings, deadline, limiter
        self.target, self.pod_gone, self.pod_starting = res.target, pod_gone, pod_starting
        self.identity = res.target.uid or res.target.name
        self.host, self.port, self.tls, self.prefix = address(res.target, settings)

    def endpoint(
        self, method: str, path: str, body: dict[str, Any] | None = None, headers: tuple[str, ...] = ()
    ) -> Endpoint:
        raw = json.dumps(body).encode() if body is not None else b""
        return endpoint(
            self.identity,
            self.host,
            self.port,
            self.tls,
            self.prefix + path,
            method,
            self.settings.token,
            raw,
            headers,
        )

    async def send(self, ep: Endpoint) -> tuple[int, str]:
        """One call, after asking pod_gone (so a token never goes to an address the target no longer
        holds); raises Gone when it says the target no longer counts."""
        if self.pod_gone is not None and (reason := await self.pod_gone(self.target)):
            raise Gone(reason)
        remaining = self.deadline - time.monotonic()
        if remaining <= 0.01:
            return 0, f"not called: timeoutSeconds ({self.settings.timeout_s:g}s) passed"
        async with self.limiter or contextlib.nullcontext():
            return await _send(
                self.pool, ep, min(self.settings.request_timeout_s, remaining), self.settings.token
            )

    async def wait_started(self) -> bool:
        """Wait while the pod is starting; whether it was. Raises Gone when it goes meanwhile, StillStarting
        when it still starts at the deadline."""
        if self.pod_starting is None or not await self.pod_starting(self.target):
            return False
        while await self.pod_starting(self.target):
            if self.pod_gone is not None and (reason := await self.pod_gone(self.target)):
                raise Gone(reason)
            left = self.deadline - time.monotonic()
            if left <= 0.01:
                raise StillStarting(
                    f"still starting at the deadline (timeoutSeconds {self.settings.timeout_s:g}s): not Ready "
                    "since its engine container started, so no Service or router has sent it traffic; not called"
                )
            await asyncio.sleep(min(STARTING_POLL_S, left))
        return True

    async def ask(
        self, method: str, path: str, body: dict[str, Any] | None, headers: tuple[str, ...]
    ) -> tuple[int, str]:
        return await self.send(self.endpoint(method, path, body, headers))

    async def info(self, engine: Engine) -> tuple[dict[str, Any] | None, str]:
        """The engine's info reply (its tiers, its ranks): (the JSON object, ""); (None, "") when every
        path is 404 (an engine too old to have one); (None, why) when a path answered otherwise."""
        why = ""
        for path in engine.info_paths:
            status, text = await self.ask("GET", path, None, ())
            if status == 404:
                continue
            try:
                info = json.loads(text) if status == 200 else None
            except ValueError:
                info = None
            if isinstance(info, dict):
                return info, ""
            why = why or (f"GET {path}: HTTP {status}" if status else f"GET {path}: {text}")
        return None, why


# judge(status, text) -> the verdict on one reply (status 0: no reply, text says why)
Judge = Callable[[int, str], Judgement]


async def call_until_final(
    pod: Pod, res: PodResult, ep: Endpoint, judge: Judge, started: float, on_call: OnCall, what: str
) -> tuple[Judgement, str] | None:
    """One call, retried until it is final: its successful judgement and reply text, or None once `res` holds
    the target's final result (Failed, NotSupported); raises Gone. Transient verdicts are retried up to
    retries_per_pod times, busy ones until the deadline, both with backoff; a pod that cannot be reached while
    it starts is waited for. `what` names the run for the deadline's message ("reset", "warmed")."""
    settings = pod.settings
    transient = busy = 0
    last = ""
    while True:
        if pod.deadline - time.monotonic() <= 0.01:
            why = f"; last: {last}" if last else ""
            decide(
                res,
                Outcome.FAILED,
                f"not {what} within timeoutSeconds ({settings.timeout_s:g}s){why}",
                started,
            )
            on_call(Verdict.FAILED.value, "deadline")
            return None
        status, text = await pod.send(ep)  # raises Gone before calling a pod that no longer counts
        res.attempts += 1
        j = judge(status, text) if status else Judgement(Verdict.TRANSIENT, text)
        res.http_status = status
        on_call(j.verdict.value, str(status))
        if j.verdict is Verdict.SUCCEEDED:
            return j, text
        if j.verdict is Verdict.NOT_SUPPORTED:
            decide(res, Outcome.NOT_SUPPORTED, j.message, started)
            return None
        if j.verdict is Verdict.FAILED:
            decide(res, Outcome.FAILED, j.message, started)
            return None
        last = j.message
        if not status and await pod.wait_started():  # it was starting: not its failure, call it again now
            transient = 0
            continue
        if j.verdict is Verdict.TRANSIENT:
            transient += 1
            if transient > settings.retries_per_pod:
                gave_up = f"gave up after {res.attempts} attempts, retriesPerPod {settings.retries_per_pod}"
                decide(res, Outcome.FAILED, f"{last} ({gave_up})", started)
                return None
        else:
            busy += 1
        n = transient if j.verdict is Verdict.TRANSIENT else busy
        delay = backoff_delay(n, settings.backoff_base_s, settings.backoff_max_s)
        await asyncio.sleep(max(0.0, min(delay, pod.deadline - time.monotonic())))


async def _reset_call(
    pod: Pod,
    res: PodResult,
    engine: Engine,
    call: ResetCall,
    started: float,
    on_call: OnCall,
) -> Judgement | None:
    """One call of the reset, retried until it is final: its successful judgement, or None once `res`
    holds the target's final result (Failed, NotSupported); raises Gone."""
    token = pod.settings.token
    ep = pod.endpoint(call.method, call.path, call.body)  # prepared once; the connection is kept per pod

    def judge(status: int, text: str) -> Judgement:
        return engine.judge(call, status, text, token)

    done = await call_until_final(pod, res, ep, judge, started, on_call, "reset")
    return None if done is None else done[0]


# job(pod, res, started): one target's calls until `res` is final (the window catches Gone and StillStarting)
Job = Callable[[Pod, PodResult, float], Awaitable[None]]


async def _one(
    pool: Pool,
    res: PodResult,
    settings: CallSettings,
    deadline: float,
    pod_gone: PodGone | None,
    pod_starting: PodStarting | None,
    limiter: asyncio.Semaphore | None,
    job: Job,
) -> None:
    """One target's job until it has a final result; `res` is updated in place. A pod loading its model is
    called once it is up."""
    started = time.monotonic()
    pod = Pod(pool, res, settings, deadline, limiter, pod_gone, pod_starting)
    try:
        await pod.wait_started()
        await job(pod, res, started)
    except Gone as gone:
        decide(res, Outcome.SKIPPED, str(gone), started)
    except StillStarting as still:
        decide(res, Outcome.SKIPPED, str(still), started)
        res.reason = STARTING


async def _reset_checked(
    pod: Pod, res: PodResult, engine: Engine, started: float, on_call: OnCall, run_id: str
) -> None:
    """Reset one target (every call its engine needs, then the canary's check when asked)."""
    settings = pod.settings
    assert isinstance(settings, ResetSettings)
    # kvpilot's ranks matter only to the canary; SGLang's tiers decide the calls
    info, why = None, ""
    if engine.info_paths and (settings.verify or engine.info_decides_calls):
        info, why = await pod.info(engine)
    if why and engine.info_decides_calls:
        # without it, a tier (SGLang's HiCache storage) could be left warm while the pod reads Succeeded
        decide(res, Outcome.FAILED, f"cannot tell which cache tiers the pod runs ({why})", started)
        return
    canary: verify.Canary | None = None
    if settings.verify:
        # the canary may take at most a quarter of what is left: the reset itself must have the rest
        budget = max(0.5, (pod.deadline - time.monotonic()) / 4)
        try:
            async with asyncio.timeout(budget):
                prepared = await verify.prepare(
                    pod.ask,
                    engine.name,
                    engine.ranks(info),
                    run_id,
                    res.name,
                    settings.scope,
                    engine.canary_words(info),
                )
        except TimeoutError:
            prepared = verify.Verification(
                Verified.UNKNOWN, f"the canary took over {budget:.1f}s before the reset"
            )
        if isinstance(prepared, verify.Canary):
            canary = prepared
        else:
            res.verify_message = prepared.message  # unknown, reported once the reset said success
    judgement: Judgement | None = None
    for call in engine.calls(settings, info):
        judgement = await _reset_call(pod, res, engine, call, started, on_call)
        if judgement is None:
            # not reset: no verdict (what earlier calls cleared stays: SGLang's flush, its storage failed)
            res.verify_message = ""
            return
        res.cleared += [t for t in judgement.tiers if t not in res.cleared]
    assert judgement is not None
    if settings.verify and canary is None:
        res.verified = Verified.UNKNOWN
    elif canary is not None:
        checked = await verify.check(pod.ask, canary, tuple(res.cleared))
        res.verified, res.verify_message = checked.verdict, checked.message
        if checked.verdict == Verified.WARM:
            decide(res, Outcome.FAILED, checked.message, started, judgement)
            res.reason = STILL_WARM
            return
    decide(res, Outcome.SUCCEEDED, judgement.message, started, judgement)


def ignore_call(verdict: str, code: str) -> None:
    """The on_call of a caller that counts nothing."""


async def run_fanout(
    targets: Sequence[Target],
    settings: ResetSettings,
    *,
    deadline: float | None = None,
    checkpoint: Checkpoint | None = None,
    pod_gone: PodGone | None = None,
    pod_starting: PodStarting | None = None,
    limiter: asyncio.Semaphore | None = None,
    stop: asyncio.Event | None = None,
    on_call: OnCall | None = None,
) -> list[PodResult]:
    """Reset every target; one result per target, sorted by name, all final unless `stop` was set (then the
    targets not decided within the shutdown grace stay Pending). `deadline` is a time.monotonic() value
    (default: now + settings.timeout_s)."""
    results = initial_results(targets)
    if settings.scope is not None and not engine_for(settings.engine).scoped_resets:
        why = (
            f"a scoped reset ({', '.join(settings.scope.to_dict())}) needs kvpilot pods: "
            f"{settings.engine} resets its whole cache only"
        )
        return _refuse(results, Outcome.NOT_SUPPORTED, why)
    engine = engine_for(settings.engine)
    on_call = on_call or ignore_call
    run_id = secrets.token_hex(6)  # names this fan-out's canaries (verify.py)

    async def job(pod: Pod, res: PodResult, started: float) -> None:
        await _reset_checked(pod, res, engine, started, on_call, run_id)

    return await run_window(
        results,
        settings,
        job,
        deadline=deadline,
        checkpoint=checkpoint,
        pod_gone=pod_gone,
        pod_starting=pod_starting,
        limiter=limiter,
        stop=stop,
        unfinished=f"not reset within timeoutSeconds ({settings.timeout_s:g}s)",
    )


def _refuse(results: list[PodResult], result: Outcome, message: str) -> list[PodResult]:
    for res in results:
        if res.result == Outcome.PENDING:
            res.result, res.message = result, message
    return results


async def run_window(
    results: list[PodResult],
    settings: CallSettings,
    job: Job,
    *,
    deadline: float | None = None,
    checkpoint: Checkpoint | None = None,
    pod_gone: PodGone | None = None,
    pod_starting: PodStarting | None = None,
    limiter: asyncio.Semaphore | None = None,
    stop: asyncio.Event | None = None,
    unfinished: str = "",
) -> list[PodResult]:
    """The sliding window: `job` on every Pending result (a reset's, a warm-up's), `settings.max_concurrency`
    at a time; `results` updated in place and returned, all final unless `stop` was set (then those not
    decided within the shutdown grace stay Pending); one left Pending at the deadline is Failed with the
    message `unfinished`."""
    deadline = deadline if deadline is not None else time.monotonic() + settings.timeout_s
    queue: asyncio.Queue[PodResult] = asyncio.Queue()
    for res in results:
        if res.result == Outcome.PENDING:
            queue.put_nowait(res)
    if queue.empty():
        return results
    if settings.token and not header_value_ok(settings.token):
        why = "the admin token is not a valid HTTP header value (a line break or control character)"
        return _refuse(results, Outcome.FAILED, why)
    stop = stop or asyncio.Event()
    # Idle connections for the window's worth of pods: a pod is called again only on a retry.
    pool = Pool(max_idle=settings.max_concurrency)

    async def worker() -> None:
        while not stop.is_set():
            try:
                res = queue.get_nowait()
            except asyncio.QueueEmpty:
                return
            if (
                pod_starting is not None
                and res.target is not None
                and deadline - time.monotonic() > STARTING_POLL_S
                and await pod_starting(res.target)
            ):
                # A pod loading its model waits at the back of the queue, not in a slot of the window the
                # pods that are up need (a window of one would spend the whole deadline on it).
                queue.put_nowait(res)
                await asyncio.sleep(STARTING_POLL_S)
                continue
            await _one(pool, res, settings, deadline, pod_gone, pod_starting, limiter, job)

    async def progress(checkpoint: Checkpoint) -> None:
        while True:
            await asyncio.sleep(settings.progress_interval_s)
            try:
                await checkpoint(results)
            except Exception as exc:  # noqa: BLE001 - progress is best effort
                log.warning("progress checkpoint failed (the fan-out goes on): %s", exc)

    workers = [asyncio.create_task(worker()) for _ in range(min(settings.max_concurrency, queue.qsize()))]
    stopping = asyncio.create_task(stop.wait())
    helpers: list[asyncio.Task[Any]] = [stopping]
    if checkpoint is not None:
        helpers.append(asyncio.create_task(progress(checkpoint)))
    all_done = asyncio.gather(*workers)
    try:
        # Slack past the deadline: each call is already bounded by it; this only guards against a stall.
        slack = max(0.0, deadline - time.monotonic()) + 2.0
        first: list[asyncio.Future[Any]] = [stopping, all_done]
        done, _ = await asyncio.wait(first, return_when=asyncio.FIRST_COMPLETED, timeout=slack)
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
            if res.result == Outcome.PENDING:
                res.result = Outcome.FAILED
                res.message = unfinished or f"no result within timeoutSeconds ({settings.timeout_s:g}s)"
    return results
