"""Where a WeightUpdate starts: kopf's daemon filter (`unfinished`) and `drive`, which runs the update of
the model's weights (update.py's `Run`) or of one LoRA adapter (adapter.py's `AdapterRun`)."""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from typing import Any

import kopf

from kvpilot.operator import metrics
from kvpilot.operator.fleets.builders import WEIGHT_UPDATES
from kvpilot.operator.kube.api import Kube
from kvpilot.operator.specs import WeightUpdateSpec
from kvpilot.operator.weights.adapter import AdapterRun
from kvpilot.operator.weights.status import update_status
from kvpilot.operator.weights.update import DONE, Run


def unfinished(status: Mapping[str, Any], **_: Any) -> bool:
    """kopf's filter of the update daemon: a finished update runs nothing (no finalizer stays on it)."""
    return (status or {}).get("phase") not in DONE


async def drive(
    kube: Kube, ns: str, name: str, logger: kopf.Logger, limiter: Any = None, catchups: Any = None
) -> None:
    """Run the update unless it is finished. `catchups` (catchup.CatchUps): no catch-up of the fleet runs
    meanwhile, and one looks at the fleet afterwards (the pods this update fenced)."""
    obj = await kube.get_cr(WEIGHT_UPDATES, ns, name)
    if obj is None or not unfinished(update_status(obj)):
        return
    spec = WeightUpdateSpec.parse(obj["spec"])
    fleet = spec.target_ref.name
    metrics.WEIGHT_UPDATES_IN_PROGRESS.inc()
    try:
        async with catchups.lock(ns, fleet) if catchups else contextlib.nullcontext():
            # made once the fleet is ours: a first run's timeout counts from here, not from the wait
            run = AdapterRun if spec.adapter is not None else Run
            await run(kube, obj, spec, logger, limiter).run()
    finally:
        metrics.WEIGHT_UPDATES_IN_PROGRESS.dec()
    if catchups:
        catchups.poke(ns, fleet)
