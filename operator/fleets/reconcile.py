"""Reconcile an InferenceDeployment: its admin token Secret, workload and Service as the builders say
(server-side apply: what we no longer set is removed, what others set is kept, a no-op writes nothing), its
status, and the annotation trigger. Idempotent: called on create/update/resume and on every event of an owned
object.

Nothing is applied while the Secret named by adminTokenSecretRef does not consent to the fleet's pods
mounting it (tokens.py), or while a Deployment, DaemonSet or Service of the fleet's name belongs to someone
else: Ready is False with the reason, and the reconcile is retried."""

from __future__ import annotations

import copy
import secrets
from collections.abc import Mapping
from typing import Any

import kopf

from kvpilot.kube.fleet_members import workload_names
from kvpilot.operator import metrics
from kvpilot.operator.fleets import builders, inference_pool, router_objects
from kvpilot.operator.fleets import network as fleet_network
from kvpilot.operator.fleets.builders import FLEETS, RESETS
from kvpilot.operator.fleets.network_policy import OperatorPeer
from kvpilot.operator.fleets.pool import PoolState, reconcile_pool
from kvpilot.operator.fleets.router import RouterState, reconcile_router
from kvpilot.operator.fleets.status import FleetStatus, RoleStatus, fleet_status
from kvpilot.operator.fleets.tokens import refusal
from kvpilot.operator.kube.api import ApiException, Kube, namespace_terminating
from kvpilot.operator.kube.conditions import fleet_conditions, set_condition
from kvpilot.operator.kube.owners import as_body, holder, owned_by
from kvpilot.operator.rbac import ROUTER_CLUSTER_ROLE
from kvpilot.operator.specs import FleetSpec

_KEEP_TOKENS = 20


async def _ensure_token_secret(
    kube: Kube, owner: dict[str, Any], spec: FleetSpec, logger: kopf.Logger
) -> None:
    """A fleet without adminTokenSecretRef gets a random token of its own, made once (never logged)."""
    name, ns = owner["metadata"]["name"], owner["metadata"]["namespace"]
    if spec.admin_token_secret_ref or spec.disable_admin_token:
        return
    ref = builders.token_secret_ref(name, spec)
    assert ref is not None
    if await kube.secret(ns, ref.name) is not None:
        return
    body = builders.generated_token_secret(name, secrets.token_urlsafe(32))
    kopf.adopt(body, owner=as_body(owner))
    try:
        await kube.create_secret(ns, body)
        logger.info("created Secret %s/%s with a generated admin token", ns, ref.name)
    except ApiException as exc:
        if exc.status != 409 and not namespace_terminating(exc):
            raise


async def _token_refusal(kube: Kube, owner: dict[str, Any], spec: FleetSpec) -> tuple[str, str] | None:
    """Why the fleet's pods may not mount the Secret its adminTokenSecretRef names (tokens.py), checked
    before anything that mounts it is applied; None when they may (or the operator generated the token)."""
    meta, ref = owner["metadata"], spec.admin_token_secret_ref
    if not ref:
        return None
    secret = await kube.secret(meta["namespace"], ref.name)
    return refusal(secret, meta["namespace"], ref, meta["uid"], "adminTokenSecretRef")


async def _name_taken(
    kube: Kube, owner: dict[str, Any], objs: list[dict[str, Any]]
) -> tuple[str, str] | None:
    """("NameConflict", message) when one of the fleet's own objects exists and is not the fleet's: it is
    never taken over (a forced apply would adopt another controller's Deployment or a user's Service)."""
    meta = owner["metadata"]
    for obj in objs:
        live = await kube.read(obj["kind"], meta["namespace"], obj["metadata"]["name"])
        if live is not None and not owned_by(live, meta["uid"]):
            name = obj["metadata"]["name"]
            return (
                "NameConflict",
                f"{obj['kind']} {name} already exists and belongs to {holder(live)}: rename one of them",
            )
    return None


async def _apply(kube: Kube, owner: dict[str, Any], desired: dict[str, Any]) -> dict[str, Any] | None:
    kopf.adopt(desired, owner=as_body(owner))
    try:
        return await kube.apply(owner["metadata"]["namespace"], desired)
    except ApiException as exc:
        if namespace_terminating(exc):
            return None
        raise


Counts = tuple[int, int, int, int, bool]  # (desired, replicas, ready, updated, stalled)


def _counts(kind: str, wl: dict[str, Any] | None, spec: FleetSpec, role: str | None) -> Counts:
    """(desired, replicas, ready, updated, stalled) of the workload of `role`."""
    if wl is None:
        return builders.role_replicas(spec, role) if kind == "Deployment" else 0, 0, 0, 0, False
    st = wl.get("status") or {}
    if kind == "Deployment":
        stalled = any(
            c.get("type") == "Progressing" and c.get("status") == "False" for c in st.get("conditions") or []
        )
        return (
            int(wl["spec"].get("replicas", 1)),
            st.get("replicas", 0),
            st.get("readyReplicas", 0),
            st.get("updatedReplicas", 0),
            stalled,
        )
    return (
        st.get("desiredNumberScheduled", 0),
        st.get("currentNumberScheduled", 0),
        st.get("numberReady", 0),
        st.get("updatedNumberScheduled", 0),
        False,
    )


def _role_status(counts: Counts) -> RoleStatus:
    _, replicas, ready, updated, _ = counts
    return {"replicas": replicas, "readyReplicas": ready, "updatedReplicas": updated}


def _stale_workloads(name: str, spec: FleetSpec) -> list[tuple[str, str]]:
    """(kind, name) of the workloads the fleet may have run before its placement or disaggregation
    changed, and runs no more."""
    wanted = {(spec.placement, builders.workload_name(name, role)) for role in builders.roles(spec)}
    names = workload_names(name, False) + workload_names(name, True)
    return [(k, n) for k in ("Deployment", "DaemonSet") for n in names if (k, n) not in wanted]


def gates(warmup: Mapping[str, Any], fleet: str) -> bool:
    """Whether a PrefixCacheWarmup holds the readiness gate of the fleet's pods: Continuous, gateReadiness,
    aimed at it, not being deleted nor Failed (one that failed at its start warms nothing)."""
    spec, st = warmup.get("spec") or {}, warmup.get("status") or {}
    return (
        spec.get("mode") == "Continuous"
        and bool(spec.get("gateReadiness"))
        and (spec.get("targetRef") or {}).get("name") == fleet
        and not warmup["metadata"].get("deletionTimestamp")
        and st.get("phase") != "Failed"
    )


async def gating_warmup(kube: Kube, ns: str, fleet: str) -> str | None:
    """The name of a PrefixCacheWarmup that gates the fleet's pods' readiness, None when none does."""
    names = sorted(
        w["metadata"]["name"] for w in await kube.list_crs(builders.WARMUPS, ns) if gates(w, fleet)
    )
    return names[0] if names else None


async def reconcile(
    kube: Kube,
    body: Any,
    logger: kopf.Logger,
    router_role: str = ROUTER_CLUSTER_ROLE,
    peer: OperatorPeer | None = None,
) -> None:
    meta, raw_spec = body["metadata"], dict(body.get("spec") or {})
    owner = {"apiVersion": body["apiVersion"], "kind": body["kind"], "metadata": dict(meta), "spec": raw_spec}
    spec = FleetSpec.parse(raw_spec)
    status = fleet_status(body)
    ns, name = meta["namespace"], meta["name"]
    kind = spec.placement
    roles = builders.roles(spec)
    gen = meta.get("generation")

    await _ensure_token_secret(kube, owner, spec, logger)
    gated = await gating_warmup(kube, ns, name) is not None
    workloads = builders.workloads(name, spec, gated)  # one per role
    own = [*workloads, builders.service(name, spec)]
    taken = await _name_taken(kube, owner, own)
    problem = taken or await _token_refusal(kube, owner, spec)
    if problem is not None:
        kopf.event(as_body(owner), type="Warning", reason=problem[0], message=problem[1])
    else:  # KV event keys someone else made are never mounted (ensure_kv_keys posts its own Event)
        problem = await fleet_network.ensure_kv_keys(kube, owner, spec, logger)
    wls: list[dict[str, Any] | None]  # each role's workload as applied or read
    if problem is None:
        wls = [await _apply(kube, owner, obj) for obj in workloads]
        await _apply(kube, owner, own[-1])
        router = await reconcile_router(kube, owner, spec, status, logger, router_role)
    else:  # nothing that would mount the token or the keys, or write over another's object, is applied
        wls = [None if taken else await kube.read(kind, ns, w["metadata"]["name"]) for w in workloads]
        router = RouterState(status.get("router"))
    workload = ",".join(f"{kind}/{w['metadata']['name']}" for w in workloads)
    pool: PoolState | None = None  # None: the pool and its condition are left as they are
    if problem is None and router.reason != "RouterNameConflict":  # never a pool naming another's Service
        pool = await reconcile_pool(kube, owner, spec, status)
    policy = await fleet_network.reconcile_policy(kube, owner, spec, status, peer or OperatorPeer())
    seen = all(wl is not None for wl in wls)
    if gen is not None and gen != status.get("observedGeneration"):
        if seen:
            kopf.event(
                as_body(owner),
                type="Normal",
                reason="Updated",
                message=f"{workload.replace('/', ' ')} applied for spec generation {gen}",
            )
        # placement or disaggregation changed: the workloads it no longer runs go (only those that are ours);
        # status.observedGeneration is written after, so a reconcile that fails before does this again
        for stale_kind, stale_name in _stale_workloads(name, spec):
            await kube.delete_owned(stale_kind, ns, stale_name, meta["uid"])

    by_role = [_counts(kind, wl, spec, role) for role, wl in zip(roles, wls, strict=True)]
    desired, replicas, ready, updated = (sum(c[i] for c in by_role) for i in range(4))
    stalled = any(c[4] for c in by_role)
    new: FleetStatus = {
        "replicas": replicas,
        "readyReplicas": ready,
        "updatedReplicas": updated,
        "selector": builders.selector_string(name),
        "observedGeneration": gen,
        "workload": workload,
        "disaggregation": (
            {role: _role_status(c) for role, c in zip(roles, by_role, strict=True) if role}
            if spec.disaggregation
            else None
        ),
        "endpoint": router_objects.endpoint(name, ns, spec),
        "router": router.status,
        "inferencePool": pool.name if pool else status.get("inferencePool"),
        "networkPolicy": policy.name,
        "conditions": fleet_conditions(
            status.get("conditions"),
            desired,
            ready,
            updated,
            gen or 0,
            seen,
            stalled,
            router.problem or policy.problem,
        ),
    }
    if problem is not None:  # Ready says why the spec is not rolled out, whatever the pods from before do
        new["conditions"] = set_condition(new["conditions"], "Ready", False, *problem, gen or 0)
    if pool is not None and pool.condition is not None:
        new["conditions"] = set_condition(
            new["conditions"], inference_pool.CONDITION, *pool.condition, gen or 0
        )
    elif pool is not None:  # no picker: no condition about its pool
        new["conditions"] = [c for c in new["conditions"] if c["type"] != inference_pool.CONDITION]

    token = (meta.get("annotations") or {}).get(builders.RESET_ANNOTATION)
    tokens = list(status.get("resetTokens") or [])
    if token and token not in tokens:
        pcr = builders.reset_for_token(name, token)
        kopf.adopt(pcr, owner=as_body(owner))
        try:
            await kube.create_cr(RESETS, ns, pcr)
            kopf.event(
                as_body(owner),
                type="Normal",
                reason="ResetRequested",
                message=f"PrefixCacheReset {pcr['metadata']['name']} for annotation token {token!r}",
            )
        except ApiException as exc:
            if exc.status != 409:  # 409: made before a crash, before the token reached status
                raise
        new["resetTokens"] = (tokens + [token])[-_KEEP_TOKENS:]

    metrics.READY_REPLICAS.labels(ns, name).set(ready)
    metrics.DESIRED_REPLICAS.labels(ns, name).set(desired)
    if any(status.get(k) != v for k, v in new.items()):
        await kube.patch_status(FLEETS, ns, name, copy.deepcopy(new))
    if problem is not None:  # a Secret labelled or a name freed later is seen on the retry
        raise kopf.TemporaryError(problem[1], delay=30)
    pool_retry = pool is not None and pool.retry
    if (
        router.retry or policy.problem or pool_retry
    ):  # status says what is wrong; look again later (a name freed, the API back)
        delay = router.retry_delay_s if router.retry else 60
        why = (
            router.message
            or (policy.problem or ("", ""))[1]
            or (pool.condition[2] if pool and pool.condition else "")
        )
        raise kopf.TemporaryError(why, delay=delay)
