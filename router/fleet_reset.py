"""Reset every pod's prefix cache through the operator's fan-out core (one HTTP fan-out, not two).

This is the only place the router touches `kvpilot.operator.fanout`: it turns pods into fan-out targets
and the fan-out's per-pod records into the router's answer (DESIGN 2b). Nothing is persisted: the router
has no status to checkpoint into, and a reset is idempotent, so a caller simply retries.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any

from kvpilot.operator.fanout import FanoutSettings, Target, initial_records, run_fanout
from kvpilot.router.pods import Pod


@dataclass(frozen=True, slots=True)
class PodReset:
    pod: str
    success: bool
    status: int  # HTTP status of the last call (0: no reply)
    epoch: int | None
    error: str | None

    def to_dict(self) -> dict[str, Any]:
        # The fan-out keeps each pod's verdict, not its reply body, so per-rank detail is not known here.
        return {"pod": self.pod, "success": self.success, "status": self.status, "epoch": self.epoch,
                "ranks": None, "error": self.error}  # fmt: skip


async def reset_pods(
    pods: list[Pod], token: str | None, reset_running_requests: bool, timeout_s: float
) -> list[PodReset]:
    # The fan-out addresses pods by IP and one port (as in a fleet); static endpoints may differ in port.
    by_port: dict[int, list[Pod]] = {}
    for p in pods:
        by_port.setdefault(p.port, []).append(p)
    deadline = time.monotonic() + timeout_s
    groups = await asyncio.gather(
        *(_reset_group(group, port, token, reset_running_requests, timeout_s, deadline)
          for port, group in by_port.items())
    )  # fmt: skip
    return sorted((r for g in groups for r in g), key=lambda r: r.pod)


async def _reset_group(pods: list[Pod], port: int, token: str | None, reset_running_requests: bool,
                       timeout_s: float, deadline: float) -> list[PodReset]:  # fmt: skip
    names = {p.host: p.name for p in pods}
    records = initial_records([Target(name=p.host, ip=p.host) for p in pods])
    settings = FanoutSettings(
        engine="kvpilot",
        port=port,
        token=token,
        reset_running_requests=reset_running_requests,
        timeout_s=timeout_s,
        request_timeout_s=min(10.0, timeout_s),
        backoff_limit=2,
    )
    await run_fanout(records, settings, deadline, _no_checkpoint)
    return [
        PodReset(
            pod=names[r["name"]],
            success=r.get("result") == "Succeeded",
            status=int(r.get("httpStatus", 0)),
            epoch=r.get("epoch"),
            error=None if r.get("result") == "Succeeded" else (r.get("message") or r.get("result")),
        )
        for r in records
    ]


async def _no_checkpoint(records: list[dict[str, Any]]) -> None:
    return None
