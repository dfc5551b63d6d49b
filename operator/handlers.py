"""kopf handlers: doors to fleets.reconcile and resets.drive, nothing more."""

from __future__ import annotations

import logging
from typing import Any

import kopf

from kvpilot.operator import fleets, metrics, resets
from kvpilot.operator.builders import GROUP, VERSION
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


@kopf.timer(GROUP, VERSION, "inferencedeployments", interval=3.0, initial_delay=1.0)
async def fleet_drift(body: kopf.Body, logger: logging.Logger, memo: kopf.Memo, **_: Any) -> None:
    await fleets.reconcile(memo.kube, body, logger)


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
