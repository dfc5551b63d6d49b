"""kopf handlers: doors to fleets.reconcile and resets.drive, nothing more."""

from __future__ import annotations

import logging
from typing import Any

import kopf

from kvpilot.operator import fleets, metrics, resets
from kvpilot.operator.builders import GROUP, MANAGED_BY, VERSION
from kvpilot.operator.kube import Kube

_fleets: set[tuple[str, str]] = set()


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    # Handler bookkeeping in our own annotations only: status belongs to the CRD schemas (it would be pruned).
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix="kvpilot.io")
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(prefix="kvpilot.io")
    settings.persistence.finalizer = "kvpilot.io/operator"
    settings.posting.level = logging.WARNING  # Events come from our code, not from kopf's log lines
    settings.watching.server_timeout = 300
    memo.kube = Kube()


@kopf.on.create(GROUP, VERSION, "inferencedeployments")
@kopf.on.update(GROUP, VERSION, "inferencedeployments")
@kopf.on.resume(GROUP, VERSION, "inferencedeployments")
async def fleet_changed(body: kopf.Body, logger: logging.Logger, memo: kopf.Memo, **_: Any) -> None:
    _fleets.add((body["metadata"]["namespace"], body["metadata"]["name"]))
    metrics.INFERENCE_DEPLOYMENTS.set(len(_fleets))
    await fleets.reconcile(memo.kube, body, logger)


@kopf.timer(GROUP, VERSION, "inferencedeployments", interval=30.0, initial_delay=5.0)
async def fleet_resync(body: kopf.Body, logger: logging.Logger, memo: kopf.Memo, **_: Any) -> None:
    # A safety net only: changes to the owned objects arrive as events (below) within a second.
    await fleets.reconcile(memo.kube, body, logger)


@kopf.on.event("apps", "v1", "deployments", labels=MANAGED_BY)
@kopf.on.event("apps", "v1", "daemonsets", labels=MANAGED_BY)
@kopf.on.event("", "v1", "services", labels=MANAGED_BY)
async def owned_changed(body: kopf.Body, namespace: str, logger: logging.Logger, memo: kopf.Memo,
                        **_: Any) -> None:  # fmt: skip
    # An owned workload or Service changed (edited, deleted, pods became ready): reconcile its owner, which
    # repairs drift and refreshes status.
    owner = next((r for r in body["metadata"].get("ownerReferences") or []
                  if r.get("kind") == "InferenceDeployment" and r.get("apiVersion") == f"{GROUP}/{VERSION}"), None)  # fmt: skip
    if owner is None:
        return
    fleet = await memo.kube.get_cr("inferencedeployments", namespace, owner["name"])
    if (
        fleet is None
        or fleet["metadata"]["uid"] != owner["uid"]
        or fleet["metadata"].get("deletionTimestamp")
    ):
        return
    await fleets.reconcile(memo.kube, fleet, logger)


@kopf.on.delete(GROUP, VERSION, "inferencedeployments", optional=True)
def fleet_deleted(namespace: str, name: str, **_: Any) -> None:
    _fleets.discard((namespace, name))
    metrics.INFERENCE_DEPLOYMENTS.set(len(_fleets))
    try:
        metrics.READY_REPLICAS.remove(namespace, name)
    except KeyError:
        pass


@kopf.daemon(GROUP, VERSION, "prefixcacheresets", cancellation_timeout=1.0)
async def reset_runs(namespace: str, name: str, stopped: kopf.DaemonStopped, logger: logging.Logger,
                     memo: kopf.Memo, **_: Any) -> None:  # fmt: skip
    # A daemon, not a create handler: it starts for every PrefixCacheReset the operator sees, also after a
    # restart, and `drive` continues from status (or only waits for the TTL when the reset is finished).
    await resets.drive(memo.kube, namespace, name, logger, stopped)
