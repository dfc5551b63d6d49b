"""A PrefixCacheWarmup in mode Continuous: it never finishes. It looks at its target every few seconds (one
pod list, and one read of the fleet or of the namespace's PrefixCacheResets) and warms:

- each pod that joins (a new uid: a scale-up, a replacement) or whose engine container restarted (its
  restartCount rose), once the engine is up (a pod still loading its model, `targets.starting`, is waited
  for, not called);
- every pod again after a PrefixCacheReset of the same target ends (the fleet's `status.lastReset`, or a
  selector reset's `status.target`) and after a WeightUpdate of the fleet changes its weights
  (`status.weightVersion`, `status.weights`);
- a pod not warmed (an error, or verified cold) again `RETRY_S` later.

Each pass is one fan-out (kvpilot.fanout.warmup) over the pods due, bounded by timeoutSeconds and
maxConcurrency; the per-pod entries are kept by name and updated in place (the latest result of each pod the
target has now), the `Warm` condition is over the current pods. An operator restart starts it over: the
first look finds every pod due (a prompt sent twice is harmless). The pure parts (`Tracker`, `pod_key`,
`markers`) are unit-tested without a cluster.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import kopf
from kubernetes.client.exceptions import ApiException

from kvpilot.fanout import Outcome, PodResult, Target
from kvpilot.fanout.results import Verified
from kvpilot.fanout.warmup import WarmPrompt, run_warmup
from kvpilot.operator import metrics
from kvpilot.operator.fleets.builders import FLEETS, RESETS, WARM_GATE, WARMUPS
from kvpilot.operator.fleets.targets import Plan, identity, pod_target, resolve
from kvpilot.operator.kube.api import Kube
from kvpilot.operator.kube.conditions import Condition, now_iso, parse_time, set_condition
from kvpilot.operator.kube.owners import as_body
from kvpilot.operator.kube.retries import RunFailure, with_retries
from kvpilot.operator.resets.podwatch import PodWatch
from kvpilot.operator.specs import WarmupSpec
from kvpilot.operator.warmups.status import WarmupStatus, pod_status, warm_condition

POLL_S = 3.0  # how often the target is looked at
RETRY_S = 30.0  # a pod not warmed is tried again this long after its last try
ERROR_BACKOFF_S = 15.0  # after a look that failed (API errors, the fleet gone)
MAX_PODS = 1000  # pods one Continuous warm-up keeps (by name, sorted): more are left out, with a warning

PodKey = tuple[str, int]  # (uid, restarts of the engine container): a new key is a pod to warm anew

# Why a pod is warmed in a pass: the label of kvpilot_operator_warmup_reapplies_total.
JOINED, RESTARTED, RESET, WEIGHTS, RETRY = "podJoined", "podRestarted", "reset", "weightUpdate", "retry"


def pod_key(pod: Mapping[str, Any], container: str | None) -> PodKey:
    """(uid, restarts): restarts of the engine container (`container`; None: of every container)."""
    st = pod.get("status") or {}
    restarts = sum(
        int(c.get("restartCount") or 0)
        for c in st.get("containerStatuses") or []
        if container is None or c.get("name") == container
    )
    return pod["metadata"].get("uid", ""), restarts


@dataclass(frozen=True, slots=True)
class Seen:
    """A pod as one look found it: `ready` when it can be warmed now (an IP, its engine running and up, not
    terminating)."""

    key: PodKey
    ready: bool


def seen(pod: Mapping[str, Any], plan: Plan) -> Seen:
    anyone = dataclasses.replace(plan, controllers=None)  # membership is checked with the pass's fresh plan
    target = pod_target(dict(pod), anyone)
    starting = identity(dict(pod), plan.container)[3]
    return Seen(pod_key(pod, plan.container), not target.skip_reason and not starting)


@dataclass(slots=True)
class Kept:
    """What the warm-up knows of one pod: its key, why it is owed a pass (None: nothing owed), the latest
    result, when it was last tried, and since when it is owed warmth while ready (None: warm)."""

    key: PodKey
    owed: str | None = JOINED
    result: PodResult | None = None
    tried: float | None = None
    cold_since: float | None = None
    gate_open: bool = False  # gateReadiness: warmed since it joined (or its engine last restarted)


@dataclass
class Tracker:
    """Per-pod state of a Continuous warm-up, by pod name (pure: the loop feeds it looks and results)."""

    retry_s: float = RETRY_S
    pods: dict[str, Kept] = field(default_factory=dict)

    def due(self, look: Mapping[str, Seen], now: float, reapply: str | None = None) -> dict[str, str]:
        """The pods to warm now, each with why; `reapply` (RESET, WEIGHTS): every pod is owed a pass. Forgets
        pods no longer there; a pod that is not ready stays owed, and is called once it is."""
        for name in [n for n in self.pods if n not in look]:
            del self.pods[name]
        out: dict[str, str] = {}
        for name in sorted(look)[:MAX_PODS]:
            s = look[name]
            kept = self.pods.get(name)
            if kept is None or kept.key[0] != s.key[0]:
                kept = self.pods[name] = Kept(s.key)
            elif kept.key != s.key:
                kept.key, kept.owed, kept.result, kept.cold_since = s.key, RESTARTED, None, None
                kept.gate_open = False  # a restarted engine cached nothing: out until warmed again
            elif reapply:
                kept.owed = reapply
            elif kept.owed is None and not _warm(kept.result) and now - (kept.tried or 0.0) >= self.retry_s:
                kept.owed = RETRY
            if kept.owed is None or not s.ready:
                continue  # nothing owed, or still starting (or without a running engine): called once ready
            if kept.cold_since is None:
                kept.cold_since = now
            out[name] = kept.owed
        return out

    def record(self, results: Sequence[PodResult], now: float) -> None:
        """A pass's results: a final one pays what the pod was owed (a pod not warmed is owed a RETRY later)."""
        for r in results:
            kept = self.pods.get(r.name)
            if kept is None or r.result == Outcome.PENDING:
                continue
            kept.result, kept.tried, kept.owed = r, now, None
            if _warm(r):
                kept.cold_since = None
                kept.gate_open = True  # once open, a later pass (a reset's) never shuts it: no outage

    def gate(self, name: str) -> bool:
        """gateReadiness: whether the pod's kvpilot.io/warm condition should be True."""
        kept = self.pods.get(name)
        return kept is not None and kept.gate_open

    def results(self, look: Mapping[str, Seen]) -> list[PodResult]:
        """The latest result of each pod kept; a pod not warmed yet is Pending (waiting for it to start)."""
        out = []
        for name in sorted(self.pods):
            kept = self.pods[name]
            if kept.result is not None:
                out.append(kept.result)
            else:
                ready = look.get(name, Seen(kept.key, False)).ready
                why = "due: to be warmed" if ready else "waiting for the pod to start"
                out.append(PodResult(name, message=why))
        return out

    def oldest_cold_s(self, look: Mapping[str, Seen], now: float) -> float:
        """How long the pod owed warmth longest has been (0: every ready pod is warm): the alert's gauge.
        A pod still starting is not counted (it serves no traffic yet)."""
        owed = [
            now - k.cold_since
            for n, k in self.pods.items()
            if k.cold_since is not None and look.get(n, Seen(k.key, False)).ready
        ]
        return max(owed, default=0.0)


def gated(pod: Mapping[str, Any]) -> bool:
    """Whether the pod carries the readiness gate kvpilot.io/warm (its template had it when it was made)."""
    return any(
        g.get("conditionType") == WARM_GATE for g in (pod.get("spec") or {}).get("readinessGates") or []
    )


def gate_status(pod: Mapping[str, Any]) -> str | None:
    """The pod's kvpilot.io/warm condition status ("True", "False"), None when it has none."""
    conds = (pod.get("status") or {}).get("conditions") or []
    return next((c.get("status") for c in conds if c.get("type") == WARM_GATE), None)


def gate_change(pod: Mapping[str, Any], warmed: bool, container: str | None) -> bool | None:
    """What to set the pod's kvpilot.io/warm condition to, None: leave it. True once `warmed` (this warm-up
    warmed it since its engine started); False when it has none yet, or when it was opened before the
    engine container last started (a restart: its process cached nothing). A True set since the engine
    started is left as it is, whoever set it (another gating warm-up of the fleet): no tug of war."""
    conds = (pod.get("status") or {}).get("conditions") or []
    cur = next((c for c in conds if c.get("type") == WARM_GATE), None)
    if warmed:
        return True if (cur or {}).get("status") != "True" else None
    if cur is None:
        return False
    if cur.get("status") != "True":
        return None
    opened = parse_time(cur.get("lastTransitionTime"))
    started = [
        parse_time(((c.get("state") or {}).get("running") or {}).get("startedAt"))
        for c in (pod.get("status") or {}).get("containerStatuses") or []
        if container is None or c.get("name") == container
    ]
    last = max((t for t in started if t is not None), default=None)
    return False if opened is not None and last is not None and opened < last else None


def _warm(r: PodResult | None) -> bool:
    """Warmed: every prompt answered on every rank, verified warm or unknown (the fan-out's Succeeded)."""
    return r is not None and r.result == Outcome.SUCCEEDED and r.verified != Verified.COLD


def fleet_marker(fleet: Mapping[str, Any] | None) -> tuple[str, str]:
    """(reset, weights) of a fleet's status: the latest reset to end, and the weights it serves; a change
    of either re-applies the warm-up to every pod."""
    st = (fleet or {}).get("status") or {}
    last = st.get("lastReset") or {}
    reset = f"{last.get('name', '')}@{last.get('time', '')}" if last else ""
    weights = json.dumps([st.get("weightVersion"), st.get("weights")], sort_keys=True)
    return reset, weights


def selector_reset_marker(resets: Sequence[Mapping[str, Any]], target: str) -> str:
    """The latest PrefixCacheReset of `target` (a selector) to end, as name@completionTime; '' when none."""
    ends = [
        (r["status"]["completionTime"], r["metadata"]["name"])
        for r in resets
        if (r.get("status") or {}).get("target") == target and (r.get("status") or {}).get("completionTime")
    ]
    if not ends:
        return ""
    t, name = max(ends)
    return f"{name}@{t}"


def reapply_reason(before: tuple[str, str] | None, now: tuple[str, str]) -> str | None:
    """RESET or WEIGHTS when the markers moved since the last look (None at the first look: the first pass
    warms every pod anyway)."""
    if before is None:
        return None
    if now[0] != before[0] and now[0]:
        return RESET
    if now[1] != before[1]:
        return WEIGHTS
    return None


class Loop:
    """One Continuous warm-up's watch, from its first look until the operator stops or it is deleted."""

    def __init__(
        self,
        kube: Kube,
        obj: dict[str, Any],
        spec: WarmupSpec,
        sends: tuple[WarmPrompt, ...],
        logger: kopf.Logger,
        stop: asyncio.Event,
        limiter: asyncio.Semaphore | None,
        start: str,
    ) -> None:
        self.kube, self.obj, self.spec, self.sends = kube, obj, spec, sends
        self.logger, self.stop, self.limiter, self.start = logger, stop, limiter, start
        self.ns, self.name = obj["metadata"]["namespace"], obj["metadata"]["name"]
        self.gen = obj["metadata"].get("generation") or 1
        st: WarmupStatus = obj.get("status") or {}  # type: ignore[assignment]
        self.passes = int(st.get("passes") or 0)
        self.conds: list[Condition] | None = st.get("conditions")
        self.tracker = Tracker()
        self.markers: tuple[str, str] | None = None
        self.written: dict[str, Any] | None = None
        self.last_trigger = st.get("lastTrigger")
        self.last_pass = st.get("lastPassTime")
        self.problem = ""
        self._look: Mapping[str, Seen] = {}
        self.container: str | None = None  # the engine container, from the plan (gate_change)

    async def run(self, plan: Plan) -> None:
        """`plan`: resolved once by the caller (a failure there fails the warm-up, as in mode Once)."""
        gauge = metrics.WARMUP_OLDEST_COLD.labels(self.ns, self.name)
        try:
            while not self.stop.is_set():
                pause = POLL_S
                try:
                    plan = await self.look(plan)
                    self.problem = ""
                except (RunFailure, ApiException) as exc:
                    reason, message = (
                        (exc.reason, exc.message) if isinstance(exc, RunFailure) else ("ApiError", str(exc))
                    )
                    if message != self.problem:
                        self.logger.warning("warm-up %s/%s: %s: %s", self.ns, self.name, reason, message)
                        kopf.event(as_body(self.obj), type="Warning", reason=reason, message=message[:1000])
                    self.problem = message
                    self.conds = set_condition(
                        self.conds, "Warm", "Unknown", reason, message[:1000], self.gen
                    )
                    await self.write({}, force=False)
                    pause = ERROR_BACKOFF_S
                if not self.stop.is_set():
                    gauge.set(self.tracker.oldest_cold_s(self._look, time.monotonic()))
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.stop.wait(), pause)
            if self.spec.gate_readiness and await self.deleted():
                await self.release(plan)
        finally:
            with contextlib.suppress(KeyError):
                metrics.WARMUP_OLDEST_COLD.remove(self.ns, self.name)

    async def markers_now(self, plan: Plan, deadline: float) -> tuple[str, str]:
        if self.spec.target_ref:
            name = self.spec.target_ref.name
            fleet = await with_retries(
                f"InferenceDeployment {self.ns}/{name}",
                lambda: self.kube.get_cr(FLEETS, self.ns, name),
                deadline,
            )
            return fleet_marker(fleet)
        resets = await with_retries(
            "list PrefixCacheResets", lambda: self.kube.list_crs(RESETS, self.ns), deadline
        )
        return selector_reset_marker(resets, plan.description), ""

    async def look(self, plan: Plan) -> Plan:
        """One look at the target, and a pass over the pods due, if any; the plan to use next time."""
        deadline = time.monotonic() + self.spec.timeout_seconds
        markers = await self.markers_now(plan, deadline)
        reapply = reapply_reason(self.markers, markers)
        pods: list[dict[str, Any]]
        pods, version = await with_retries(
            "list pods", lambda: self.kube.list_pods(self.ns, plan.selector), deadline
        )
        if len(pods) > MAX_PODS:
            self.logger.warning(
                "warm-up %s/%s: %d pods, only the first %d are kept warm",
                self.ns,
                self.name,
                len(pods),
                MAX_PODS,
            )
        by_name = {p["metadata"]["name"]: p for p in pods}
        self.container = plan.container
        self._look = {n: seen(p, plan) for n, p in by_name.items()}
        due = self.tracker.due(self._look, time.monotonic(), reapply)
        self.markers = markers
        if due:
            plan = await resolve(self.kube, self.ns, self.spec, deadline)  # fresh token, fresh workload
            await self.warm(plan, [pod_target(by_name[n], plan) for n in sorted(due)], due, version, deadline)
        await self.write(self._status(), force=bool(due))
        if self.spec.gate_readiness:
            await self.open_gates(pods)
        return plan

    async def open_gates(self, pods: Sequence[Mapping[str, Any]], release: bool = False) -> None:
        """gateReadiness: each gated pod's kvpilot.io/warm condition as the tracker says (True once warmed;
        `release`: True for every pod, the warm-up going away), patched where the listing differs."""
        for pod in pods:
            meta = pod["metadata"]
            if not gated(pod) or meta.get("deletionTimestamp"):
                continue
            change = (
                (gate_status(pod) != "True" or None)
                if release
                else gate_change(pod, self.tracker.gate(meta["name"]), self.container)
            )
            if change is None:
                continue
            want = change
            reason, message = (
                ("Released", f"PrefixCacheWarmup {self.name} deleted: the gate no longer holds")
                if release
                else ("Warm", f"warmed by PrefixCacheWarmup {self.name}")
                if want
                else ("NotWarm", f"not warmed yet by PrefixCacheWarmup {self.name}")
            )
            cond = {
                "type": WARM_GATE,
                "status": "True" if want else "False",
                "reason": reason,
                "message": message,
                "lastTransitionTime": now_iso(),
            }
            try:
                await self.kube.patch_pod_condition(self.ns, meta["name"], meta["uid"], cond)
            except ApiException as exc:
                if exc.status not in (404, 409):  # gone, or another pod of the name now: the next look
                    self.logger.warning(
                        "warm-up %s/%s: gate of %s not set: %s", self.ns, self.name, meta["name"], exc.reason
                    )

    async def release(self, plan: Plan) -> None:
        """The warm-up is being deleted: open the gate of every pod (they would never be Ready otherwise);
        the fleet's template loses the gate meanwhile (handlers.py, a rollout)."""
        try:
            pods: list[dict[str, Any]] = (await self.kube.list_pods(self.ns, plan.selector))[0]
            await self.open_gates(pods, release=True)
        except ApiException as exc:
            self.logger.warning("warm-up %s/%s: gates not released: %s", self.ns, self.name, exc.reason)

    async def deleted(self) -> bool:
        try:
            obj = await self.kube.get_cr(WARMUPS, self.ns, self.name)
        except ApiException:
            return False
        return obj is None or bool(obj["metadata"].get("deletionTimestamp"))

    async def warm(
        self, plan: Plan, targets: list[Target], due: Mapping[str, str], version: str, deadline: float
    ) -> None:
        from kvpilot.operator.warmups.drive import settings_for  # drive imports this module

        whys = sorted(set(due.values()))
        self.logger.info(
            "warm-up %s/%s: warming %d pods (%s)", self.ns, self.name, len(targets), ", ".join(whys)
        )
        idents = {t.name: (t.uid, t.ip, False, False) for t in targets}
        async with PodWatch(
            self.kube, self.ns, plan.selector, plan.container, idents, version, "warm-up"
        ) as w:
            results = await run_warmup(
                targets,
                settings_for(self.spec, plan, self.sends),
                deadline=deadline,
                pod_gone=w.gone,
                pod_starting=w.starting,
                limiter=self.limiter,
                stop=self.stop,
                on_call=metrics.count_warmup_call,
            )
        if self.stop.is_set():
            return  # interrupted: the next operator (or nobody, once deleted) starts over
        self.tracker.record(results, time.monotonic())
        for r in results:
            metrics.WARMUP_REAPPLIES.labels(self.ns, due[r.name]).inc()
        metrics.count_warmup_pods(self.ns, results)
        for r in [r for r in results if not _warm(r) and r.result != Outcome.SKIPPED][:10]:
            kopf.event(
                as_body(self.obj), type="Warning", reason="PodNotWarmed", message=f"{r.name}: {r.message}"
            )
        self.passes += 1
        self.last_pass, self.last_trigger = now_iso(), ",".join(whys)

    def _status(self) -> WarmupStatus:
        results = self.tracker.results(self._look)
        self.conds = set_condition(self.conds, "Warm", *warm_condition(results), self.gen)
        body: WarmupStatus = {"phase": "Watching", **pod_status(results), "passes": self.passes}
        if self.last_pass:
            body["lastPassTime"] = self.last_pass
        if self.last_trigger:
            body["lastTrigger"] = self.last_trigger
        return body

    async def write(self, body: WarmupStatus, force: bool) -> None:
        full = {**body, "conditions": self.conds, "startTime": self.start, "observedGeneration": self.gen}
        if not force and full == self.written:
            return
        try:
            await self.kube.patch_status(WARMUPS, self.ns, self.name, full)
            self.written = full
        except ApiException as exc:  # written at the next look
            self.logger.warning("warm-up %s/%s: status not written: %s", self.ns, self.name, exc.reason)
