"""A WeightUpdate from start to finish: every pod of an InferenceDeployment to new weights, through the
daemon's weight routes (checkpoint transport: each pod reads spec.modelPath), with the fleet's own token only.

Atomic is a two-phase commit over the pods (and, inside each daemon, over its ranks):
1. stage: /abort_weight_update (a stage left by an interrupted run), /start_weight_update, /update_weights
   on every pod. Only when every pod staged the same digest does the commit start; if any stage fails, times
   out or differs, the stage is dropped everywhere and the update ends Failed with no pod changed.
2. commit: on every pod, /pause?mode=pauseMode, /finish_weight_update {weight_version}, /resume. A pod whose
   finish failed is Fenced: named in status, the update ends Degraded, and once some pod serves the new
   weights it is taken out of the fleet's Service (fence.py). A pod an earlier update fenced is let back once this one commits on it.
Rolling runs the same two phases over maxUnavailable pods at a time; a failed batch stops it there.

An adapter update (spec.adapter) changes one LoRA adapter instead of the model: adapter.py.

Every update ends within timeoutSeconds, counted from status.startTime (a restart does not extend it). A run
that an operator restart interrupted starts over: staging again drops the old stage first, and finishing the
same weights again on a pod that already serves them is harmless (the same digest), so it is at-least-once.
At the end every pod is asked what it serves (/weight_info): status.pods[].version and the
InferenceDeployment's status.weightVersion come from those answers, never from what we expected.

An update that committed on at least one pod (Succeeded, or Degraded with the others fenced) records the
fleet's weights in the InferenceDeployment's status.weights {version, modelPath, digest, model}: what catchup.py
brings every pod back to. One whose commit failed on every pod fences none and leaves status.weights as it
was (the fleet is still on its old weights); a Rolling update that failed part way clears it (the fleet has
no one version then).
"""

from __future__ import annotations

import contextlib
import enum
import logging
import time
from collections.abc import Sequence
from typing import Any

import kopf

from kvpilot.fanout import CallSettings, Target
from kvpilot.fanout.phase import PhaseReply, Step, run_phase, run_steps
from kvpilot.operator import metrics
from kvpilot.operator.fleets.builders import FLEETS, WEIGHT_UPDATES
from kvpilot.operator.fleets.status import FleetWeights, fleet_status
from kvpilot.operator.fleets.targets import Plan, fleet_plan, pod_target, read_fleet
from kvpilot.operator.kube.api import ApiException, Kube
from kvpilot.operator.kube.conditions import now_iso, parse_time, set_condition
from kvpilot.operator.kube.owners import as_body
from kvpilot.operator.kube.retries import RunFailure, with_retries
from kvpilot.operator.specs import ROLLING_MAX_UNAVAILABLE, FleetSpec, WeightUpdateSpec
from kvpilot.operator.weights import fence
from kvpilot.operator.weights.status import (
    PodUpdate,
    WeightPhase,
    WeightResult,
    WeightUpdateStatus,
    fleet_weight_version,
    pod_status,
    rank_entries,
    redact,
    update_status,
)

DONE: tuple[WeightPhase, ...] = ("Succeeded", "Failed", "Degraded")
# Of timeoutSeconds, the part kept back from staging for dropping the stage or switching (at most this).
RESERVE_S = 15.0
log = logging.getLogger(__name__)


class _Keep(enum.Enum):
    KEEP = "keep"  # status.weights left as it is (an update that changed no pod)


class Run:
    def __init__(
        self, kube: Kube, obj: dict[str, Any], spec: WeightUpdateSpec, logger: kopf.Logger, limiter: Any
    ) -> None:
        self.kube, self.obj, self.spec, self.logger, self.limiter = kube, obj, spec, logger, limiter
        self.ns, self.name = obj["metadata"]["namespace"], obj["metadata"]["name"]
        status = update_status(obj)
        self.start = status.get("startTime") or now_iso()
        started = parse_time(status.get("startTime"))
        timeout = float(self.spec.timeout_seconds)
        self.deadline = time.monotonic() + timeout - (time.time() - started if started else 0)
        # A pod that never answers its stage must leave time to drop the stage on the others.
        self.stage_deadline = self.deadline - min(RESERVE_S, timeout / 4)
        self.pods: list[PodUpdate] = []
        self.target = f"InferenceDeployment/{self.spec.target_ref.name}"
        # pods out of the Service (label kvpilot.io/serving "false"), as far as known
        self.fenced: set[str] = set()
        # the fleet's status.weights once the update ends (None: removed)
        self.weights: FleetWeights | None | _Keep = _Keep.KEEP

    # ---- status ------------------------------------------------------------------------------------
    async def patch(self, phase: WeightPhase, end: WeightUpdateStatus | None = None) -> dict[str, Any]:
        """Write status: the phase, each pod's entry and `end` (what the final write adds)."""
        body: WeightUpdateStatus = {
            "phase": phase,
            "target": self.target,
            "version": self.spec.version,
            "startTime": self.start,
            "observedGeneration": self.obj["metadata"].get("generation"),
        }
        if self.pods:
            body.update(pod_status(self.pods))
        if end:
            body.update(end)
        return await self.kube.patch_status(WEIGHT_UPDATES, self.ns, self.name, body)

    async def progress(self, phase: WeightPhase) -> None:
        try:
            await self.patch(phase)
        except Exception as exc:  # noqa: BLE001 - progress is for people; the final write is retried
            self.logger.warning("weight update %s/%s: progress not written: %s", self.ns, self.name, exc)

    # ---- the run -----------------------------------------------------------------------------------
    async def run(self) -> None:
        await self.progress("Pending")
        fleet = self.spec.target_ref.name
        try:
            if (body := await read_fleet(self.kube, self.ns, fleet, self.deadline)) is None:
                raise RunFailure("TargetNotFound", f"InferenceDeployment {self.ns}/{fleet} not found")
            plan = await fleet_plan(
                self.kube, self.ns, body["metadata"], FleetSpec.parse(body.get("spec")), self.deadline
            )
            targets = await self.targets(plan)
        except RunFailure as f:
            return await self.finish("Failed", f.reason, f.message)
        settings = CallSettings(
            port=plan.port,
            token=plan.token,
            timeout_s=float(self.spec.timeout_seconds),
            request_timeout_s=float(self.spec.timeout_seconds),
            max_concurrency=self.spec.max_concurrency,
        )
        self.pods = [PodUpdate(t.name) for t in targets]
        await self.update(targets, settings)

    async def update(self, targets: list[Target], settings: CallSettings) -> None:
        """The model's weights on every pod, Atomic or Rolling (the module docstring); an adapter's are
        adapter.py's `AdapterRun.update`."""
        model_path = self.spec.model_path
        assert model_path is not None  # the CRD: modelPath or adapter, and an adapter's run is AdapterRun
        batch = len(targets)
        if self.spec.strategy == "Rolling":
            batch = max(1, self.spec.max_unavailable or ROLLING_MAX_UNAVAILABLE)
        kopf.event(
            as_body(self.obj),
            type="Normal",
            reason="Started",
            message=f"updating {len(targets)} pods of {self.target} to {self.spec.version}",
        )
        for i in range(0, len(targets), batch):
            group = targets[i : i + batch]
            if not await self.stage(group, settings):
                await self.read_versions(targets, settings)
                done = sum(p.result == WeightResult.SUCCEEDED for p in self.pods)
                first = next(p for p in self.pods if p.result == WeightResult.FAILED)
                why = f"{first.name}: {first.message}"
                if done:  # Rolling: earlier batches serve the new version
                    self.weights = None  # no one version to bring pods back to
                    msg = f"a stage failed after {done} pods were updated ({why}); the fleet is on mixed versions"
                    return await self.finish("Failed", "StageFailed", msg)
                return await self.finish("Failed", "StageFailed", f"no pod changed; {why}")
            await self.commit(group, settings)
        await self.fence_behind(targets)  # a Rolling batch's failures, once a later batch succeeded
        await self.read_versions(targets, settings)
        await self.unfence(targets, "on the fleet's weights again")
        digest = self.pods[0].staged_digest
        fenced = [p.name for p in self.pods if p.result == WeightResult.FENCED]
        if not any(p.result == WeightResult.SUCCEEDED for p in self.pods):  # the fleet stays on its weights
            why = "not fenced: no pod changed weights"
            msg = f"no pod serves {self.spec.version}: {', '.join(fenced[:5])} ({why})"
            return await self.finish("Degraded", "CommitFailed", msg)
        self.weights = {
            "version": self.spec.version,
            "modelPath": model_path,
            "digest": digest,
        }
        if fenced:
            msg = f"{len(fenced)} pods are not on {self.spec.version}: {', '.join(fenced[:5])} (fenced)"
            return await self.finish("Degraded", "CommitFailed", msg)
        msg = f"{len(self.pods)}/{len(self.pods)} pods serve {self.spec.version} ({digest})"
        return await self.finish("Succeeded", "AllPodsUpdated", msg, digest=digest)

    async def targets(self, plan: Plan) -> list[Target]:
        """Every pod of the fleet, each callable: an update that cannot reach a pod does not start."""
        pods: list[dict[str, Any]]
        pods, _ = await with_retries(
            "list pods", lambda: self.kube.list_pods(self.ns, plan.selector), self.deadline
        )
        targets = sorted((pod_target(p, plan) for p in pods), key=lambda t: t.name)
        self.fenced = {p["metadata"]["name"] for p in pods if not fence.serving(p)}
        if not targets:
            raise RunFailure("NoTargets", f"{self.target} has no pods")
        blocked = [t for t in targets if t.skip_reason]
        if blocked:
            names = ", ".join(f"{t.name} ({t.skip_reason})" for t in blocked[:5])
            raise RunFailure("PodsNotReady", f"no pod changed: not every pod can be called: {names}")
        return targets

    def _by_name(self) -> dict[str, PodUpdate]:
        return {p.name: p for p in self.pods}

    async def call(
        self,
        group: Sequence[Target],
        settings: CallSettings,
        method: str,
        path: str,
        body: Any = None,
    ) -> dict[str, PhaseReply]:
        return await run_phase(
            group, settings, method, path, body, deadline=self.deadline, limiter=self.limiter
        )

    async def stage(self, group: Sequence[Target], settings: CallSettings) -> bool:
        """Phase one on `group`: True when every pod staged the same digest; else the stage is dropped
        on every pod of the group and the failing pods are Failed, the others Dropped."""
        await self.progress("Staging")
        pods = self._by_name()
        info = {"update_info": {"model_path": self.spec.model_path}}
        steps = [
            Step("POST", "/abort_weight_update", must_succeed=False),  # a stage an earlier run left
            Step("POST", "/start_weight_update"),
            Step("POST", "/update_weights", info),
        ]
        replies = await run_steps(group, settings, steps, deadline=self.stage_deadline, limiter=self.limiter)
        failed: dict[str, str] = {}
        for n, seq in replies.items():
            last = seq[-1]
            if last.body.get("ranks"):
                pods[n].ranks = rank_entries(last.body)
            if len(seq) < len(steps) or not last.ok:
                i, bad = next((i, r) for i, r in enumerate(seq) if not r.ok)  # the first, the cause
                failed[n] = f"{steps[i].path}: {bad.message}"
            else:
                pods[n].staged_digest = str(last.body.get("staged_digest") or "")
                pods[n].result = WeightResult.STAGED
        digests = {pods[t.name].staged_digest for t in group if t.name not in failed}
        if not failed and len(digests) == 1:
            return True
        if not failed:  # every pod staged, but not the same weights: a path that differs between nodes
            failed = {t.name: f"staged {pods[t.name].staged_digest}, not what the others did" for t in group}
        await self.call(group, settings, "POST", "/abort_weight_update")
        for t in group:
            p = pods[t.name]
            p.result, p.message = (
                (WeightResult.FAILED, redact(failed[t.name]))
                if t.name in failed
                else (WeightResult.DROPPED, "")
            )
        return False

    async def commit(self, group: Sequence[Target], settings: CallSettings) -> None:
        """Phase two on `group`: pause, finish, resume; a pod whose finish failed is Fenced."""
        await self.progress("Committing")
        pods = self._by_name()
        mode = self.spec.pause_mode
        version = self.spec.version
        paused = await self.call(group, settings, "POST", f"/pause?mode={mode}")
        held = [t for t in group if paused[t.name].ok]  # a pod that did not pause is not switched
        body = {"weight_version": version}
        finished = await self.call(held, settings, "POST", "/finish_weight_update", body) if held else {}
        if held:
            await self.call(held, settings, "POST", "/resume")
        for t in group:
            p, r = pods[t.name], finished.get(t.name) or paused[t.name]
            if r.body.get("ranks"):
                p.ranks = rank_entries(r.body)
            if r.ok and r.body.get("weight_version") == version and r.body.get("digest") == p.staged_digest:
                p.result, p.message = WeightResult.SUCCEEDED, ""
            else:
                p.result = WeightResult.FENCED
                served = f"serves {r.body.get('weight_version')} ({r.body.get('digest')})"
                p.message = redact(f"commit: {r.message or served}")
        await self.fence_behind(group)

    async def fence_behind(self, group: Sequence[Target]) -> None:
        """Take the Fenced pods of `group` out of the Service once some pod serves the new weights (then they
        are behind the fleet); while none does, the fleet is still on its old weights, as they are."""
        if not any(p.result == WeightResult.SUCCEEDED for p in self.pods):
            return
        pods = self._by_name()
        for t in group:
            p = pods[t.name]
            if (
                p.result == WeightResult.FENCED and t.name not in self.fenced
            ):  # out of the Service until it is back
                if await fence.set_serving(self.kube, self.ns, t.name, t.uid, False, p.message, self.obj):
                    self.fenced.add(t.name)

    async def unfence(self, group: Sequence[Target], why: str) -> None:
        """Let the pods of `group` that this run updated and that were fenced back into the Service."""
        for t in group:
            p = self._by_name()[t.name]
            if p.result == WeightResult.SUCCEEDED and t.name in self.fenced:
                if await fence.set_serving(self.kube, self.ns, t.name, t.uid, True, why, self.obj):
                    self.fenced.discard(t.name)

    async def read_versions(self, targets: Sequence[Target], settings: CallSettings) -> None:
        """What every pod serves now, as it says (status.pods[].version); unknown when it does not answer."""
        pods = self._by_name()
        replies = await run_phase(
            targets, settings, "GET", "/weight_info", deadline=self.deadline + 10, limiter=self.limiter
        )
        for n, r in replies.items():
            pods[n].version = str(r.body.get("weight_version") or "") if r.ok else ""

    async def finish(self, phase: WeightPhase, reason: str, message: str, digest: str = "") -> None:
        """The end: conditions, Event, metrics, the fleet's weightVersion, then the final status write
        (after it lands kopf's filter no longer matches and the daemon and its finalizer go)."""
        self.logger.info("weight update %s/%s: %s: %s", self.ns, self.name, phase, message)
        gen = self.obj["metadata"].get("generation") or 1
        conds = update_status(self.obj).get("conditions")
        kind = {"Succeeded": "Complete", "Failed": "Failed", "Degraded": "Degraded"}[phase]
        conds = set_condition(conds, kind, True, reason, message, gen)
        kopf.event(
            as_body(self.obj),
            type="Normal" if phase == "Succeeded" else "Warning",
            reason=phase,
            message=message,
        )
        metrics.WEIGHT_UPDATES.labels(self.ns, phase).inc()
        if (t0 := parse_time(self.start)) is not None:
            metrics.WEIGHT_UPDATE_DURATION.observe(max(0.0, time.time() - t0))
        if self.pods:
            await self.fleet_version()
        end: WeightUpdateStatus = {"completionTime": now_iso(), "conditions": conds}
        if digest:
            end["digest"] = digest
        await with_retries("final status", lambda: self.patch(phase, end), time.monotonic() + 30)

    async def fleet_version(self) -> None:
        fleet = self.spec.target_ref.name
        versions = [p.version or "unknown" for p in self.pods]
        body = fleet_weight_version(versions)
        per_version = body["weightVersions"]
        try:
            old = await self.kube.get_cr(FLEETS, self.ns, fleet) or {}
            if self.weights is not _Keep.KEEP:  # with the model they were committed over (fence.recorded_for)
                model = FleetSpec.parse(old.get("spec")).model or ""
                body["weights"] = None if self.weights is None else {**self.weights, "model": model}
            gone = set(fleet_status(old).get("weightVersions") or {}) - set(per_version)
            for version in gone:  # a merge patch keeps map keys it does not name
                per_version[version] = None
                with contextlib.suppress(KeyError):
                    metrics.FLEET_WEIGHT_PODS.remove(self.ns, fleet, version)
            for version, n in per_version.items():
                if n is not None:
                    metrics.FLEET_WEIGHT_PODS.labels(self.ns, fleet, version).set(n)
            await self.kube.patch_status(FLEETS, self.ns, fleet, body)
            metrics.FENCED_PODS.labels(self.ns, fleet).set(len(self.fenced))
        except ApiException as exc:  # informative; the update's own status is written next
            if exc.status != 404:
                log.warning("weightVersion of %s/%s not written: %s", self.ns, fleet, exc.reason)
