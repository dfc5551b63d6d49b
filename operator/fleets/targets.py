"""The pods of an InferenceDeployment as targets of a run: a PrefixCacheReset, a PrefixCacheWarmup, a
WeightUpdate, a catch-up.

A fleet's pods are called with the fleet's own admin token, and only those its workload runs: a pod that
merely carries the fleet's labels never sees the token (fleet_members). A reset and a warm-up aim alike
(`TargetedSpec`: a targetRef or a selector): `resolve` turns either into a `Plan`, `list_targets` lists its
pods (waiting for a fleet whose pods are still coming).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable
from dataclasses import dataclass
from functools import partial
from typing import Any

from kvpilot.fanout import Target
from kvpilot.kube.fleet_members import ROLE_LABEL, is_member, workload_controllers
from kvpilot.operator.fleets import builders, tokens
from kvpilot.operator.fleets.builders import FLEETS
from kvpilot.operator.kube.api import Kube
from kvpilot.operator.kube.conditions import parse_time
from kvpilot.operator.kube.owners import controlled_by
from kvpilot.operator.kube.retries import RunFailure, with_retries
from kvpilot.operator.specs import FleetSpec, SecretKeyRef, TargetedSpec

Identity = tuple[str, str, bool, bool]  # (uid, pod IP, terminating, starting): what the pod watch keeps


@dataclass(frozen=True, slots=True)
class Plan:
    """What a run is aimed at, resolved from its spec."""

    description: str  # InferenceDeployment/NAME or the selector
    selector: str  # label selector of the candidate pods
    port: int
    token: str | None
    container: str | None  # the engine container that must be running; None: any container
    controllers: frozenset[str] | None  # uids that must control a pod (its fleet's workload), None: any
    waits_for_pods: bool = False  # a fleet that wants pods but has none to call yet is waited for


@dataclass(frozen=True, slots=True)
class PodTarget(Target):
    """A pod as a target, with its role in a disaggregated fleet (label kvpilot.io/role; "" for a colocated
    pod or a selector's), which its entry in a run's status names."""

    role: str = ""


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
    # a fleet's pods only: a selector's pods may wear the label for reasons of their own
    role = (meta.get("labels") or {}).get(ROLE_LABEL, "") if plan.controllers is not None else ""
    return PodTarget(
        meta["name"],
        st.get("podIP") or "",
        spec.get("nodeName", ""),
        meta.get("uid", ""),
        skip_reason=skip,
        role=role,
    )


# The kubelet reports a restarted container's pod not Ready a status sync after the container started:
# a Ready=False that follows the start by less than this is the start's own, not a fall from Ready
# (readiness probes take periodSeconds x failureThreshold, 10 s at least by default, to take a pod out).
READY_SYNC_SLACK_S = 5.0


def starting(pod: dict[str, Any], container: str | None) -> bool:
    """Whether the pod's engine container runs but the pod has not been Ready since it started: it is
    still loading its model, no Service or router has sent it traffic, and its process has cached
    nothing (a disk tier may hold what an earlier container wrote, so a reset waits for it rather than
    passing it by)."""
    st = pod.get("status") or {}
    if restarting(pod, container):
        return True
    engines = [
        c
        for c in st.get("containerStatuses") or []
        if "running" in (c.get("state") or {}) and (container is None or c.get("name") == container)
    ]
    # every one ready: with no container named (a selector), a ready sidecar says nothing of the engine
    if not engines or all(c.get("ready") for c in engines):
        return False
    ready = next((c for c in st.get("conditions") or [] if c.get("type") == "Ready"), None)
    if ready is None:
        return True
    if ready.get("status") == "True":
        return False
    fell = parse_time(ready.get("lastTransitionTime"))
    began = max((parse_time(c["state"]["running"].get("startedAt")) or 0.0) for c in engines)
    return fell is None or fell <= began + READY_SYNC_SLACK_S


def restarting(pod: dict[str, Any], container: str | None) -> bool:
    """Whether the kubelet is restarting the pod's engine container: it exited (killed, `crictl stop`, a crash)
    in a Running pod whose restartPolicy brings it back, and is waiting (a back-off) or terminated a moment ago.
    Its process, and all it cached in memory, is gone; the next one starts empty. With no container named (a
    selector), only when no container runs: a running sidecar keeps the pod's calls going as before."""
    st = pod.get("status") or {}
    if st.get("phase") != "Running" or (pod.get("spec") or {}).get("restartPolicy") == "Never":
        return False
    engines = [
        c for c in st.get("containerStatuses") or [] if container is None or c.get("name") == container
    ]
    return bool(engines) and not any("running" in (c.get("state") or {}) for c in engines)


def identity(pod: dict[str, Any], container: str | None) -> Identity:
    """(uid, pod IP, terminating, starting) of a pod as a dict; `container`: its engine container's name
    (None: any), for `starting`."""
    meta, st = pod["metadata"], pod.get("status") or {}
    return (
        meta.get("uid", ""),
        st.get("podIP") or "",
        bool(meta.get("deletionTimestamp")),
        starting(pod, container),
    )


async def secret_token(
    kube: Kube, ns: str, ref: SecretKeyRef, deadline: float, use: str, owner_uid: str | None
) -> str:
    """The token of `ref`, if its Secret consents to being sent (tokens.refusal); `owner_uid`: the targeted
    InferenceDeployment, whose own Secret counts as consented."""
    secret = await with_retries(f"Secret {ns}/{ref.name}", lambda: kube.secret(ns, ref.name), deadline)
    if problem := tokens.refusal(secret, ns, ref, owner_uid, use):
        raise RunFailure(*problem)
    assert secret is not None
    return secret["data"][ref.key].strip()


async def read_fleet(kube: Kube, ns: str, name: str, deadline: float) -> dict[str, Any] | None:
    """The InferenceDeployment, None when there is none."""
    return await with_retries(
        f"InferenceDeployment {ns}/{name}", lambda: kube.get_cr(FLEETS, ns, name), deadline
    )


async def _fleet_controllers(
    kube: Kube, ns: str, meta: dict[str, Any], spec: FleetSpec, deadline: float
) -> frozenset[str]:
    """uids of the objects that directly control the fleet's pods (fleet_members.workload_controllers), of
    every role's workload."""
    uid, kind = meta["uid"], spec.placement
    sel = builders.selector_string(meta["name"])
    controllers: frozenset[str] = frozenset()
    rsets: list[dict[str, Any]] | None = None  # listed once, for the first Deployment that is the fleet's
    for role in builders.roles(spec):
        name = builders.workload_name(meta["name"], role)
        wl = await with_retries(f"{kind} {ns}/{name}", partial(kube.read, kind, ns, name), deadline)
        if rsets is None and kind == "Deployment" and wl is not None and controlled_by(wl, uid):
            rsets = await with_retries("list ReplicaSets", lambda: kube.list_replicasets(ns, sel), deadline)
        controllers |= workload_controllers(uid, wl, rsets or ())
    return controllers


async def fleet_plan(
    kube: Kube, ns: str, meta: dict[str, Any], spec: FleetSpec, deadline: float, port: int | None = None
) -> Plan:
    """The pods of the InferenceDeployment (its metadata and spec as read), its token and workload; `port`
    instead of the fleet's own. Raises RunFailure with a reason when it cannot go on."""
    name = meta["name"]
    ref = builders.token_secret_ref(name, spec)
    use = f"the admin token of {name}"
    token = await secret_token(kube, ns, ref, deadline, use, meta["uid"]) if ref else None
    controllers = await _fleet_controllers(kube, ns, meta, spec, deadline)
    wants_pods = spec.placement == "DaemonSet" or any(
        builders.role_replicas(spec, r) > 0 for r in builders.roles(spec)
    )
    return Plan(
        f"InferenceDeployment/{name}",
        builders.selector_string(name),
        port or spec.port,
        token,
        builders.CONTAINER,
        controllers,
        wants_pods,
    )


def describe(spec: TargetedSpec) -> str:
    """status.target, from the spec alone: InferenceDeployment/NAME, or the selector."""
    if spec.target_ref:
        return f"InferenceDeployment/{spec.target_ref.name}"
    return builders.label_selector(spec.selector or {})


async def resolve(kube: Kube, ns: str, spec: TargetedSpec, deadline: float) -> Plan:
    """The run's targets and token; raises RunFailure with a reason when it cannot go on."""
    if not spec.target_ref:
        sel = builders.label_selector(spec.selector or {})
        ref = spec.admin_token_secret_ref
        token = await secret_token(kube, ns, ref, deadline, "adminTokenSecretRef", None) if ref else None
        # a selector's pods: the port an InferenceDeployment's daemons default to
        return Plan(sel, sel, spec.port or FleetSpec().port, token, None, None)
    name = spec.target_ref.name
    while (fleet := await read_fleet(kube, ns, name, deadline)) is None:
        if not spec.wait_for_target:
            hint = "set spec.waitForTarget: true to wait for it until timeoutSeconds"
            raise RunFailure("TargetNotFound", f"InferenceDeployment {ns}/{name} not found ({hint})")
        if time.monotonic() >= deadline - 0.05:  # waited for it to appear until the deadline
            waited = f"timeoutSeconds ({spec.timeout_seconds}s, waitForTarget)"
            raise RunFailure("TargetNotFound", f"InferenceDeployment {ns}/{name} not found within {waited}")
        await asyncio.sleep(max(0.0, min(1.0, deadline - 0.05 - time.monotonic())))
    return await fleet_plan(
        kube, ns, fleet["metadata"], FleetSpec.parse(fleet.get("spec")), deadline, spec.port
    )


@dataclass(frozen=True, slots=True)
class Listed:
    """A run's pods as listed once at its start: the plan, each pod's target and identity (for the pod
    watch), and the list's resourceVersion (where the watch starts)."""

    plan: Plan
    pods: list[tuple[Target, Identity]]
    version: str

    @property
    def targets(self) -> list[Target]:
        return [t for t, _ in self.pods]


async def list_targets(
    kube: Kube, ns: str, spec: TargetedSpec, deadline: float, log: logging.Logger | logging.LoggerAdapter[Any]
) -> Listed:
    """Resolve the spec and list its pods, each looked at once, as it is decoded; a fleet that wants pods but
    has none to call yet (just created) is listed again each second until one can be called or the deadline
    is a second away (then what was listed: NoTargets). Raises RunFailure."""
    while True:
        plan = await resolve(kube, ns, spec, deadline)
        t_list = time.monotonic()

        def list_pods(plan: Plan = plan) -> Awaitable[Any]:
            return kube.list_pods(
                ns, plan.selector, lambda p: (pod_target(p, plan), identity(p, plan.container))
            )

        pods, version = await with_retries("list pods", list_pods, deadline)
        log.info("%s: listed %d pods in %.3fs", plan.description, len(pods), time.monotonic() - t_list)
        callable_ = any(not t.skip_reason and t.ip for t, _ in pods)
        if callable_ or not plan.waits_for_pods or time.monotonic() >= deadline - 1.0:
            return Listed(plan, pods, version)
        await asyncio.sleep(1.0)  # a fleet just created: its pods are coming
