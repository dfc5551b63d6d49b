"""Reset every pod's prefix cache through the operator's fan-out core (one HTTP fan-out, not two).

This is the only place the router touches `kvpilot.operator.fanout`: it turns pods into fan-out targets
and the fan-out's per-pod records into the router's answer (DESIGN 2b). Nothing is persisted: the router
has no status to checkpoint into, and a reset is idempotent, so a caller simply retries.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvpilot.operator.fanout import FanoutSettings, Target, run_fanout
from kvpilot.router.pods import Pod


@dataclass(frozen=True, slots=True)
class PodReset:
    pod: str
    success: bool
    status: int  # HTTP status of the last call (0: no reply)
    epoch: int | None
    error: str | None
    ranks: list[dict[str, Any]] | None = None  # as the daemon names the fields (None: not reported)

    def to_dict(self) -> dict[str, Any]:
        return {"pod": self.pod, "success": self.success, "status": self.status, "epoch": self.epoch,
                "ranks": self.ranks, "error": self.error}  # fmt: skip


def _daemon_ranks(ranks: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """The fan-out's status entries (camelCase) back in the daemon's reply names."""
    if ranks is None:
        return None
    return [{("evicted_blocks" if k == "evictedBlocks" else k): v for k, v in r.items()} for r in ranks]


async def reset_pods(
    pods: list[Pod], token: str | None, reset_running_requests: bool, timeout_s: float
) -> list[PodReset]:
    settings = FanoutSettings(
        engine="kvpilot",
        token=token,
        reset_running_requests=reset_running_requests,
        timeout_s=timeout_s,
        request_timeout_s=min(10.0, timeout_s),
        retries_per_pod=2,
    )
    # Each target carries its own base URL: static endpoints may differ in port and scheme.
    records = await run_fanout([Target(name=p.name, url=p.url) for p in pods], settings)
    return sorted(
        (
            PodReset(
                pod=r.name,
                success=r.result == "Succeeded",
                status=r.http_status or 0,
                epoch=r.epoch,
                error=None if r.result == "Succeeded" else (r.message or r.result),
                ranks=_daemon_ranks(r.ranks),
            )
            for r in records
        ),
        key=lambda r: r.pod,
    )
