"""kopf handlers: doors to fleets.reconcile, resets.drive, warmups.drive, weights.drive and the expiries, nothing
more.

Finalizers: kopf puts `kvpilot.io/operator` only on objects a daemon, a timer or a non-optional delete
handler serves. That is a PrefixCacheReset (or a PrefixCacheWarmup, a WeightUpdate) while it runs (the daemon's filter drops it once it is finished,
and kopf then removes the finalizer), and never an InferenceDeployment: what it owns is garbage-collected
through ownerReferences, and its delete handler only drops gauges (optional). So once no operator runs,
only a reset that was running when it went keeps a finalizer (docs/install.md, uninstall).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Mapping
from typing import Any

import kopf

from kvpilot.operator import metrics
from kvpilot.operator.fleets import inference_pool
from kvpilot.operator.fleets import reconcile as fleets
from kvpilot.operator.fleets.builders import (
    FLEETS,
    GROUP,
    MANAGED_BY,
    RESETS,
    VERSION,
    WARMUPS,
    WEIGHT_UPDATES,
)
from kvpilot.operator.fleets.status import fleet_status
from kvpilot.operator.kube.api import Kube
from kvpilot.operator.kube.owners import owner_of_kind
from kvpilot.operator.resets import drive as resets
from kvpilot.operator.resets.expiry import Expiry
from kvpilot.operator.specs import FleetSpec, WarmupSpec, WeightUpdateSpec
from kvpilot.operator.warmups import drive as warmups
from kvpilot.operator.weights import drive as weights
from kvpilot.operator.weights.catchup import CatchUps

# The fleets this process has seen, behind the inference_deployments gauge: process state, as the metrics
# registry it feeds is (a restarted operator counts again from its resume handlers).
_fleets: set[tuple[str, str]] = set()
# How long a stopping operator lets calls in flight finish (a reset's shutdown grace is a little shorter).
# A constant, not a knob: kopf reads it when the handler below is registered, at import.
SHUTDOWN_GRACE_S = 10.0


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    # Handler bookkeeping in our own annotations only: status belongs to the CRD schemas (it would be pruned).
    # Not under kvpilot.io/ itself: kopf leaves annotations under its prefix out of the diff, and a change of
    # kvpilot.io/reset-prefix-cache must reach the update handler.
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix="operator.kvpilot.io")
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(prefix="operator.kvpilot.io")
    settings.persistence.finalizer = "kvpilot.io/operator"
    settings.posting.level = logging.WARNING  # Events come from our code, not from kopf's log lines
    settings.watching.server_timeout = 300
    # Owned objects are watched with the label selector applied by the API server: only ours reach us.
    managed = ",".join(f"{k}={v}" for k, v in MANAGED_BY.items())
    for group, plural in (
        ("apps", "deployments"),
        ("apps", "daemonsets"),
        ("", "services"),
        ("", "serviceaccounts"),
        ("rbac.authorization.k8s.io", "rolebindings"),
        ("networking.k8s.io", "networkpolicies"),
    ):
        settings.watching.label_selectors[group, plural] = managed
    memo.kube = Kube()
    memo.expiry = Expiry(memo.kube)
    memo.weight_expiry = Expiry(memo.kube, WEIGHT_UPDATES, "WeightUpdate", WeightUpdateSpec)
    memo.warmup_expiry = Expiry(memo.kube, WARMUPS, "PrefixCacheWarmup", WarmupSpec)
    # Calls to pods in flight across all resets of this process: main.run puts the flag's value in the memo.
    memo.limiter = asyncio.Semaphore(memo.max_calls_in_flight)
    memo.catchups = CatchUps(memo.kube, memo.limiter)  # fleets' pods back on their weights (catchup.py)


@contextlib.asynccontextmanager
async def _counted(kind: str) -> AsyncIterator[None]:
    try:
        yield
    except Exception:
        metrics.RECONCILE_ERRORS.labels(kind).inc()
        raise


@kopf.on.create(GROUP, VERSION, FLEETS)
@kopf.on.update(GROUP, VERSION, FLEETS)
@kopf.on.resume(GROUP, VERSION, FLEETS)
async def fleet_changed(body: kopf.Body, logger: kopf.Logger, memo: kopf.Memo, **_: Any) -> None:
    _fleets.add((body["metadata"]["namespace"], body["metadata"]["name"]))
    metrics.INFERENCE_DEPLOYMENTS.set(len(_fleets))
    async with _counted("InferenceDeployment"):
        await fleets.reconcile(memo.kube, body, logger, memo.router_cluster_role, memo.operator_peer)
    _catch_up(memo, body)


def _catch_up(memo: kopf.Memo, fleet: Mapping[str, Any]) -> None:
    # A fleet with recorded weights: its pods are looked at (a readiness change of one of them, a restart,
    # a new pod all reconcile the fleet through its workload's status).
    if fleet_status(fleet).get("weights"):
        memo.catchups.poke(fleet["metadata"]["namespace"], fleet["metadata"]["name"])


@kopf.on.event("apps", "v1", "deployments", labels=MANAGED_BY)
@kopf.on.event("apps", "v1", "daemonsets", labels=MANAGED_BY)
@kopf.on.event("", "v1", "services", labels=MANAGED_BY)
@kopf.on.event("", "v1", "serviceaccounts", labels=MANAGED_BY)  # the router's identity (spec.router)
@kopf.on.event("rbac.authorization.k8s.io", "v1", "rolebindings", labels=MANAGED_BY)
@kopf.on.event("networking.k8s.io", "v1", "networkpolicies", labels=MANAGED_BY)  # spec.networkPolicy
async def owned_changed(
    body: kopf.Body, namespace: str | None, logger: kopf.Logger, memo: kopf.Memo, **_: Any
) -> None:
    assert namespace is not None  # a namespaced kind
    # An owned object changed (edited, deleted, pods became ready): reconcile its owner, which
    # applies it again (a no-op unless someone changed our fields) and refreshes status.
    owner = owner_of_kind(body, f"{GROUP}/{VERSION}", "InferenceDeployment")
    if owner is None:
        return
    fleet = await memo.kube.get_cr(FLEETS, namespace, owner["name"])
    if (
        fleet is None
        or fleet["metadata"]["uid"] != owner["uid"]
        or fleet["metadata"].get("deletionTimestamp")
    ):
        return
    async with _counted("InferenceDeployment"):
        await fleets.reconcile(memo.kube, fleet, logger, memo.router_cluster_role, memo.operator_peer)
    _catch_up(memo, fleet)


@kopf.on.event(
    "apiextensions.k8s.io",
    "v1",
    "customresourcedefinitions",
    when=lambda name, **_: name == inference_pool.CRD_NAME,
)
async def pool_crd_changed(logger: kopf.Logger, memo: kopf.Memo, **_: Any) -> None:
    # GAIE's InferencePool CRD installed, established or removed after the fleets were reconciled: no event
    # of theirs follows, so each fleet whose router is its endpoint picker is reconciled now (its pool made,
    # or its condition turned to CRDNotInstalled). The initial listing comes here too, before or after the
    # fleets' own resume handlers: either way each one is reconciled once more.
    for ns, name in sorted(_fleets):
        fleet = await memo.kube.get_cr(FLEETS, ns, name)
        if fleet is None or fleet["metadata"].get("deletionTimestamp"):
            continue
        if inference_pool.endpoint_picker(FleetSpec.parse(fleet.get("spec"))) is None:
            continue
        # A problem of one fleet (written to its status) must not keep the others from being looked at.
        with contextlib.suppress(kopf.TemporaryError):
            async with _counted("InferenceDeployment"):
                await fleets.reconcile(memo.kube, fleet, logger, memo.router_cluster_role, memo.operator_peer)


@kopf.on.delete(GROUP, VERSION, FLEETS, optional=True)
def fleet_deleted(namespace: str | None, name: str, **_: Any) -> None:
    assert namespace is not None  # a namespaced kind
    _fleets.discard((namespace, name))
    metrics.INFERENCE_DEPLOYMENTS.set(len(_fleets))
    for gauge in (metrics.READY_REPLICAS, metrics.DESIRED_REPLICAS, metrics.FENCED_PODS):
        with contextlib.suppress(KeyError):
            gauge.remove(namespace, name)


@kopf.on.cleanup()
async def stop_expiry(memo: kopf.Memo, **_: Any) -> None:
    await memo.expiry.close()
    await memo.weight_expiry.close()
    await memo.warmup_expiry.close()
    await memo.catchups.close()


@kopf.daemon(GROUP, VERSION, RESETS, cancellation_timeout=SHUTDOWN_GRACE_S, when=resets.unfinished)
async def reset_runs(
    namespace: str | None,
    name: str,
    stopped: kopf.DaemonStopped,
    logger: kopf.Logger,
    memo: kopf.Memo,
    **_: Any,
) -> None:
    assert namespace is not None  # a namespaced kind
    # A daemon, not a create handler: it starts for every unfinished PrefixCacheReset the operator sees, also
    # after a restart, and `drive` starts an interrupted reset over. Finished ones match no daemon: no finalizer.
    async with _counted("PrefixCacheReset"):
        await resets.drive(memo.kube, namespace, name, logger, stopped, memo.limiter)


@kopf.on.event(GROUP, VERSION, RESETS)
async def reset_seen(type: str | None, body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:  # noqa: A002 - kopf's name
    # Every event, the initial listing included: a finished reset's TTL, without a daemon (and its finalizer).
    # async: kopf runs sync handlers in threads, and the expiry tasks belong to the event loop.
    memo.expiry.seen(body, deleted=type == "DELETED")


@kopf.daemon(GROUP, VERSION, WARMUPS, cancellation_timeout=SHUTDOWN_GRACE_S, when=warmups.unfinished)
async def warmup_runs(
    namespace: str | None,
    name: str,
    stopped: kopf.DaemonStopped,
    logger: kopf.Logger,
    memo: kopf.Memo,
    **_: Any,
) -> None:
    assert namespace is not None  # a namespaced kind
    # As for resets: a daemon starts for every unfinished PrefixCacheWarmup, also after a restart (it starts
    # over: a prompt sent twice is harmless); the pod calls share the process's cap (memo.limiter).
    async with _counted("PrefixCacheWarmup"):
        await warmups.drive(memo.kube, namespace, name, logger, stopped, memo.limiter)


@kopf.on.event(GROUP, VERSION, WARMUPS)
async def warmup_seen(
    type: str | None,  # noqa: A002 - kopf's name
    body: kopf.Body,
    logger: kopf.Logger,
    memo: kopf.Memo,
    **_: Any,
) -> None:
    memo.warmup_expiry.seen(body, deleted=type == "DELETED")
    spec, st = body.get("spec") or {}, body.get("status") or {}
    target = (spec.get("targetRef") or {}).get("name")
    if not (spec.get("mode") == "Continuous" and spec.get("gateReadiness") and target):
        return
    # A gating warm-up came, went (or is going), or failed at its start: its fleet's pod template gains or
    # loses the readiness gate (fleets/reconcile.py `gating_warmup`).
    if (
        type in ("ADDED", "DELETED")
        or body["metadata"].get("deletionTimestamp")
        or st.get("phase") == "Failed"
    ):
        ns = body["metadata"]["namespace"]
        fleet = await memo.kube.get_cr(FLEETS, ns, target)
        if fleet is None or fleet["metadata"].get("deletionTimestamp"):
            return
        async with _counted("InferenceDeployment"):
            await fleets.reconcile(memo.kube, fleet, logger, memo.router_cluster_role, memo.operator_peer)


@kopf.daemon(GROUP, VERSION, WEIGHT_UPDATES, cancellation_timeout=SHUTDOWN_GRACE_S, when=weights.unfinished)
async def weight_update_runs(
    namespace: str | None, name: str, logger: kopf.Logger, memo: kopf.Memo, **_: Any
) -> None:
    assert namespace is not None  # a namespaced kind
    # As for resets: a daemon starts for every unfinished WeightUpdate, also after a restart (it starts over).
    async with _counted("WeightUpdate"):
        await weights.drive(memo.kube, namespace, name, logger, memo.limiter, memo.catchups)


@kopf.on.event(GROUP, VERSION, WEIGHT_UPDATES)
async def weight_update_seen(type: str | None, body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:  # noqa: A002
    memo.weight_expiry.seen(body, deleted=type == "DELETED")
