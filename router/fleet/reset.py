"""Reset every pod's prefix cache through the shared fan-out (`kvpilot.fanout`, the one a PrefixCacheReset
uses too): the router's pods become fan-out targets, and the per-pod results become the router's answer
(docs/router.md, "POST /reset_prefix_cache"). Nothing is persisted: the router has no status to
checkpoint into, and a reset is idempotent, so a caller simply retries.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from kvpilot.fanout import Outcome, PodResult, RankResult, ResetSettings, Target, Verified, run_fanout
from kvpilot.kv.reset_scope import ResetScope
from kvpilot.router.fleet.pods import Pod

# Retries of a transient failure per pod, one fewer than a PrefixCacheReset's default (docs/router.md):
# a dead pod is given up on sooner while the caller waits for the answer.
RETRIES_PER_POD = 2


@dataclass(frozen=True, slots=True)
class PodReset:
    pod: str
    success: bool
    status: int  # HTTP status of the last call (0: no reply)
    epoch: int | None
    error: str | None
    ranks: list[dict[str, Any]] | None = None  # as the daemon names the fields (None: not reported)
    cleared: list[str] | None = None  # the cache tiers the pod's engine says its reset cleared
    verified: Verified | None = None  # None: not verified
    verify_message: str | None = None  # how the canary proved it, or why it could not; None: not verified
    reason: str | None = None  # why a pod failed, machine-readable: "StillWarm"; None otherwise

    def to_dict(self) -> dict[str, Any]:
        return {
            "pod": self.pod,
            "success": self.success,
            "status": self.status,
            "epoch": self.epoch,
            "ranks": self.ranks,
            "cleared": self.cleared,
            "verified": self.verified,
            "verify_message": self.verify_message,
            "reason": self.reason,
            "error": self.error,
        }


def _rank_json(rank: RankResult) -> dict[str, Any]:
    """A rank as the daemon reported it: fields it did not report are left out."""
    return {key: value for key, value in asdict(rank).items() if value is not None}


def _pod_reset(result: PodResult) -> PodReset:
    ok = result.result == Outcome.SUCCEEDED
    error = None if ok else (result.message or result.result)
    if error is not None and result.reason:
        error = f"{result.reason}: {error}"  # a warm pod's error starts with why, as its reason field says
    return PodReset(
        pod=result.name,
        success=ok,
        status=result.http_status or 0,
        epoch=result.epoch,
        error=error,
        ranks=None if result.ranks is None else [_rank_json(r) for r in result.ranks],
        # a pod that failed before its reset was done cleared nothing for sure: null, not []
        cleared=list(result.cleared) if result.cleared or ok else None,
        verified=result.verified,
        verify_message=result.verify_message or None,
        reason=result.reason or None,
    )


async def reset_pods(
    pods: list[Pod],
    engine: str,
    token: str | None,
    timeout_s: float,
    *,
    reset_running_requests: bool = False,
    reset_external: bool = True,
    verify: bool = True,
    scope: ResetScope | None = None,
) -> list[PodReset]:
    """Reset `pods`, which run `engine`: the fan-out's engine adapter calls each its own way and judges
    its reply (vLLM's `{"success": false}`, SGLang's 400 while busy, retried until the deadline); with
    `verify`, each pod's canary before and after proves it cold, and a pod still warm fails (StillWarm)."""
    settings = ResetSettings(
        engine=engine,
        token=token,
        reset_running_requests=reset_running_requests,
        reset_external=reset_external,
        verify=verify,
        scope=scope,
        timeout_s=timeout_s,
        request_timeout_s=min(10.0, timeout_s),
        retries_per_pod=RETRIES_PER_POD,
    )
    # Each target carries its own base URL: static endpoints may differ in port and scheme.
    results = await run_fanout([Target(name=p.name, url=p.url) for p in pods], settings)
    return [_pod_reset(r) for r in results]  # sorted by pod name, as the fan-out returns them
