"""ttlSecondsAfterFinished: delete a finished PrefixCacheReset (or WeightUpdate, PrefixCacheWarmup) when its time is up,
also after a restart.

Not a kopf daemon or timer: kopf keeps its finalizer on every object a daemon or timer serves, and a finished
reset carries none (after `helm uninstall`, `kubectl delete pcr --all` must not hang). An event handler sees
every reset, the initial listing too (so a restarted operator takes the TTLs up again), and this keeps one
sleeping task per finished reset that has a TTL. Deleting twice is harmless: the uid is a precondition, and
404 and 409 count as done.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any

from kvpilot.fanout.backoff import backoff_delay
from kvpilot.operator.fleets.builders import RESETS
from kvpilot.operator.kube.api import Kube, is_transient
from kvpilot.operator.kube.conditions import parse_time
from kvpilot.operator.specs import ResetSpec, WarmupSpec, WeightUpdateSpec

log = logging.getLogger(__name__)


class Expiry:
    def __init__(
        self,
        kube: Kube,
        plural: str = RESETS,
        kind: str = "PrefixCacheReset",
        spec_type: type[ResetSpec | WarmupSpec | WeightUpdateSpec] = ResetSpec,
    ) -> None:
        self.kube, self.plural, self.kind, self.spec_type = kube, plural, kind, spec_type
        self.tasks: dict[str, asyncio.Task[None]] = {}  # by uid

    def seen(self, body: dict[str, Any], deleted: bool = False) -> None:
        """A watch event of a reset: schedule its deletion once it is finished, forget it once it is gone."""
        meta = body["metadata"]
        uid = meta["uid"]
        if deleted or meta.get("deletionTimestamp"):
            if task := self.tasks.pop(uid, None):
                task.cancel()
            return
        ttl = self.spec_type.parse(body.get("spec")).ttl_seconds_after_finished
        done = parse_time((body.get("status") or {}).get("completionTime"))
        if ttl is None or done is None or uid in self.tasks:
            return
        self.tasks[uid] = asyncio.create_task(
            self._expire(meta["namespace"], meta["name"], uid, done + ttl, ttl)
        )

    async def _expire(self, ns: str, name: str, uid: str, at: float, ttl: int) -> None:
        try:
            await asyncio.sleep(max(0.0, at - time.time()))
            log.info("deleting %s %s/%s: ttlSecondsAfterFinished %ss passed", self.kind, ns, name, ttl)
            failures = 0
            while True:
                try:
                    await self.kube.delete_cr(self.plural, ns, name, uid)
                    return
                except Exception as exc:  # noqa: BLE001 - retried while it may pass, else reported
                    if not is_transient(exc):
                        log.warning("%s %s/%s not deleted after its TTL: %s", self.kind, ns, name, exc)
                        return
                failures += 1
                await asyncio.sleep(backoff_delay(failures, 1.0, 60.0, jitter=False))
        finally:
            if self.tasks.get(uid) is asyncio.current_task():
                del self.tasks[uid]

    async def close(self) -> None:
        """Cancel every pending deletion (the operator stops; the next one schedules them again)."""
        tasks, self.tasks = list(self.tasks.values()), {}
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
