"""Catch-up: every pod of a fleet back on the fleet's weights (InferenceDeployment status.weights, which a
WeightUpdate that committed writes), so that a fenced pod is fenced only until it is back.

A pod comes back on other weights when its container restarts (it loads its --model again), when the
workload makes a new one (scale-up, a replaced pod), or when its commit failed. One loop per fleet, started
(`poke`) by the fleet's reconcile (which every readiness change of its pods sets off, through the workload's
status) and at the end of every WeightUpdate; each pass asks every pod /weight_info and acts on fence.decide:
- on the fleet's weights: un-fenced if it was fenced;
- other weights: fenced, then driven through the WeightUpdate's own stage and commit (update.py's Run) alone,
  with the recorded modelPath and version; un-fenced when it then serves the recorded digest;
- not Ready and not answering (restarting, loading): fenced now, caught up once it answers.
The loop ends once every pod serves the fleet's weights. One catch-up per pod at a time; a pod whose
catch-up failed waits 5 s, 10 s, ... up to 5 min before the next (it stays fenced meanwhile, as does a pod
that never answers); an Event on the InferenceDeployment and a log line for every action. A WeightUpdate of
the fleet and its catch-up never run at once (`lock`): each would drop the other's stage. Weights recorded
over another spec.model than the fleet's now are dropped, not forced on pods of the new model.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

import kopf

from kvpilot.fanout import CallSettings, Target
from kvpilot.fanout.backoff import backoff_delay
from kvpilot.fanout.phase import run_phase
from kvpilot.kube.fleet_members import is_member
from kvpilot.operator import metrics
from kvpilot.operator.fleets.builders import FLEETS, GROUP, VERSION, WEIGHT_UPDATES
from kvpilot.operator.fleets.status import FleetStatus, FleetWeights, fleet_status
from kvpilot.operator.fleets.targets import fleet_plan, pod_target
from kvpilot.operator.kube.api import Kube
from kvpilot.operator.kube.owners import as_body
from kvpilot.operator.kube.retries import RunFailure
from kvpilot.operator.specs import FleetSpec, TargetRef, WeightUpdateSpec
from kvpilot.operator.weights import fence
from kvpilot.operator.weights.drive import unfinished
from kvpilot.operator.weights.status import PodUpdate, WeightResult, update_status
from kvpilot.operator.weights.update import Run

log = logging.getLogger(__name__)

PASS_INTERVAL_S = 3.0  # between two passes of a fleet with a pod not yet back
CATCH_UP_TIMEOUT_S = 300.0  # one pod's stage and commit
BACKOFF_S, BACKOFF_MAX_S = 5.0, 300.0
ASK_TIMEOUT_S = 10.0  # a pod's /weight_info
MAX_CATCH_UPS = 16  # pods of one fleet caught up at once (each stages a host copy of the weights)


class CatchUpRun(Run):
    """The WeightUpdate's stage and commit on the pods of one fleet, for no WeightUpdate: no status of its
    own, its Events on the InferenceDeployment."""

    async def progress(self, phase: str) -> None:
        return None


class CatchUps:
    """The operator's catch-up loops (process state, in kopf's memo): one per fleet at most."""

    def __init__(self, kube: Kube, limiter: asyncio.Semaphore | None = None) -> None:
        self.kube, self.limiter = kube, limiter
        self._loops: dict[tuple[str, str], asyncio.Task[None]] = {}
        self._locks: dict[tuple[str, str], asyncio.Lock] = {}
        # per fleet: pod uid -> (failed catch-ups, not before); pods gone are dropped at each pass
        self._backoff: dict[tuple[str, str], dict[str, tuple[int, float]]] = {}

    @contextlib.asynccontextmanager
    async def lock(self, ns: str, fleet: str) -> AsyncIterator[None]:
        async with self._locks.setdefault((ns, fleet), asyncio.Lock()):
            yield

    def poke(self, ns: str, fleet: str) -> None:
        """Start the fleet's loop unless it runs."""
        key = (ns, fleet)
        if key in self._loops and not self._loops[key].done():
            return
        self._loops[key] = asyncio.create_task(self._loop(ns, fleet), name=f"catch-up {ns}/{fleet}")

    async def close(self) -> None:
        for task in self._loops.values():
            task.cancel()
        for task in self._loops.values():
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task

    async def _loop(self, ns: str, fleet: str) -> None:
        while True:
            try:
                async with self.lock(ns, fleet):
                    more = await self.one_pass(ns, fleet)
            except RunFailure as f:  # the fleet's token or pods cannot be read now: try again later
                log.warning("catch-up of %s/%s: %s: %s", ns, fleet, f.reason, f.message)
                more = True
            except Exception:  # noqa: BLE001 - a loop that dies would leave fenced pods fenced
                log.exception("catch-up of %s/%s failed; trying again", ns, fleet)
                more = True
            if not more:
                return
            await asyncio.sleep(PASS_INTERVAL_S)

    async def one_pass(self, ns: str, fleet: str) -> bool:
        """One look at every pod of the fleet; True while some pod is not back on the fleet's weights."""
        body = await self.kube.get_cr(FLEETS, ns, fleet)
        if body is None or body["metadata"].get("deletionTimestamp"):
            return False
        weights = fleet_status(body).get("weights")
        if not weights or not weights.get("version"):
            return False
        spec = FleetSpec.parse(body.get("spec"))
        if not fence.recorded_for(weights, spec):
            await self._forget(body, weights)
            return False
        if await self._update_running(ns, fleet):
            return True  # it ends by its timeout and pokes this loop again; until then, look again later
        deadline = time.monotonic() + CATCH_UP_TIMEOUT_S
        plan = await fleet_plan(self.kube, ns, body["metadata"], spec, deadline)
        pods: list[dict[str, Any]]
        pods, _ = await self.kube.list_pods(ns, plan.selector)
        pods = [p for p in pods if not p["metadata"].get("deletionTimestamp")]
        targets = {p["metadata"]["name"]: pod_target(p, plan) for p in pods}
        settings = CallSettings(port=plan.port, token=plan.token, request_timeout_s=ASK_TIMEOUT_S)
        callable_ = [t for t in targets.values() if not t.skip_reason]
        replies = await run_phase(
            callable_, settings, "GET", "/weight_info", deadline=time.monotonic() + 2 * ASK_TIMEOUT_S
        )
        lagging: list[Target] = []
        more = False
        backoff = self._backoff.setdefault((ns, fleet), {})
        for gone in set(backoff) - {p["metadata"]["uid"] for p in pods}:
            del backoff[gone]
        fenced = {p["metadata"]["name"] for p in pods if not fence.serving(p)}
        for pod in pods:
            name, uid = pod["metadata"]["name"], pod["metadata"]["uid"]
            t = targets[name]
            if plan.controllers is not None and not is_member(pod, plan.controllers):
                continue  # not the fleet's pod: never called, never fenced
            r = replies.get(name)
            answer = r.body if r is not None and r.ok else None
            action = fence.decide(weights, answer, fence.is_ready(pod))
            if action == fence.SERVE:
                backoff.pop(uid, None)
                back = "on the fleet's weights"
                if not fence.serving(pod) and await fence.set_serving(
                    self.kube, ns, name, uid, True, back, body
                ):
                    fenced.discard(name)
                continue
            more = True
            if action in (fence.FENCE, fence.CATCH_UP) and fence.serving(pod):
                why = "not answering while not Ready" if action == fence.FENCE else _serves(answer)
                if await fence.set_serving(self.kube, ns, name, uid, False, why, body):
                    fenced.add(name)
            if action == fence.CATCH_UP:  # one at a time: the pass waits for its catch-ups
                if time.monotonic() >= backoff.get(uid, (0, 0.0))[1]:
                    lagging.append(t)
        if lagging:
            window = asyncio.Semaphore(MAX_CATCH_UPS)

            async def bounded(t: Target) -> bool:
                async with window:
                    return await self._catch_up(body, weights, t, settings, backoff)

            caught = await asyncio.gather(*(bounded(t) for t in lagging))
            fenced -= {t.name for t, ok in zip(lagging, caught, strict=True) if ok}
        metrics.FENCED_PODS.labels(ns, fleet).set(len(fenced))
        return more

    async def _forget(self, body: dict[str, Any], weights: FleetWeights) -> None:
        """spec.model changed since the weights were recorded: the fleet rolls out on the new model, which is
        its weights from now on; the record goes (a pod fenced before is replaced by the rollout)."""
        ns, fleet = body["metadata"]["namespace"], body["metadata"]["name"]
        forget: FleetStatus = {"weights": None}
        await self.kube.patch_status(FLEETS, ns, fleet, forget)
        message = f"spec.model changed since {weights['version']} was recorded: no pod is brought back to it"
        log.info("catch-up of %s/%s: %s", ns, fleet, message)
        kopf.event(as_body(body), type="Normal", reason="WeightsForgotten", message=message)

    async def _update_running(self, ns: str, fleet: str) -> bool:
        updates = await self.kube.list_crs(WEIGHT_UPDATES, ns)
        return any(
            WeightUpdateSpec.parse(u.get("spec")).target_ref.name == fleet and unfinished(update_status(u))
            for u in updates
        )

    async def _catch_up(
        self,
        body: dict[str, Any],
        weights: FleetWeights,
        t: Target,
        settings: Any,
        backoff: dict[str, tuple[int, float]],
    ) -> bool:
        """Stage and commit the fleet's weights on one fenced pod; un-fence it when it serves them (True
        once it is back in the Service)."""
        ns, fleet = body["metadata"]["namespace"], body["metadata"]["name"]
        obj = {
            "apiVersion": f"{GROUP}/{VERSION}",
            "kind": "InferenceDeployment",
            "metadata": body["metadata"],
        }
        spec = WeightUpdateSpec(
            target_ref=TargetRef(name=fleet),
            model_path=weights.get("modelPath") or "",
            version=weights["version"],
            timeout_seconds=int(CATCH_UP_TIMEOUT_S),  # read as float(timeout_seconds): the same 300.0
        )
        run = CatchUpRun(self.kube, obj, spec, log, self.limiter)
        run.pods = [PodUpdate(t.name)]
        run.fenced = {t.name}
        log.info("catch-up of %s/%s: %s to %s", ns, fleet, t.name, weights["version"])
        full = CallSettings(
            port=settings.port,
            token=settings.token,
            timeout_s=CATCH_UP_TIMEOUT_S,
            request_timeout_s=CATCH_UP_TIMEOUT_S,
        )
        p = run.pods[0]
        if await run.stage([t], full):
            if weights.get("digest") and p.staged_digest != weights["digest"]:
                await run.call([t], full, "POST", "/abort_weight_update")
                p.result, p.message = (
                    WeightResult.FAILED,
                    f"staged {p.staged_digest}, the fleet serves {weights['digest']}",
                )
            else:
                await run.commit([t], full)
        if p.result == WeightResult.SUCCEEDED:
            backoff.pop(t.uid, None)
            await run.unfence([t], f"caught up to {weights['version']}")
            return t.name not in run.fenced
        failures = backoff.get(t.uid, (0, 0.0))[0] + 1
        delay = backoff_delay(failures, BACKOFF_S, BACKOFF_MAX_S, jitter=False)  # said in the Event as it is
        backoff[t.uid] = (failures, time.monotonic() + delay)
        message = f"{t.name}: catch-up to {weights['version']} failed ({p.message}); next try in {delay:.0f}s"
        log.warning("catch-up of %s/%s: %s", ns, fleet, message)
        kopf.event(as_body(obj), type="Warning", reason="CatchUpFailed", message=message)
        return False


def _serves(answer: dict[str, Any] | None) -> str:
    a = answer or {}
    return f"serves {a.get('weight_version')} ({a.get('digest')}), not the fleet's weights"
