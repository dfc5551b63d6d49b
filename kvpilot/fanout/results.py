"""What a fan-out reports: one `PodResult` per target, with one `RankResult` per data-parallel rank when
the pod reports its ranks. Field names follow the daemon's reply (snake_case); callers rename them for
their own audience."""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvpilot.fanout.targets import Target
from kvpilot.protocol.pins import PinResult


@dataclass(frozen=True, slots=True)
class RankResult:
    """One data-parallel rank's part of a pod's reset reply."""

    rank: int
    success: bool
    epoch: int | None = None
    evicted_blocks: int | None = None


class Outcome(enum.StrEnum):
    """A target's result, under the names PrefixCacheReset status.pods[].result shows; PENDING until final."""

    PENDING = "Pending"
    SUCCEEDED = "Succeeded"
    FAILED = "Failed"
    SKIPPED = "Skipped"
    NOT_SUPPORTED = "NotSupported"


class Verified(enum.StrEnum):
    """What a reset's canary proved of a pod (verify.py), or a warm-up's second sends (warmup.py)."""

    # a reset: after it the canary found no more cached than a control prompt; a warm-up: a prompt not held
    COLD = "cold"
    # a reset: the canary was still served from cache (it did not hold); a warm-up: every prompt was held
    WARM = "warm"
    UNKNOWN = "unknown"  # the pod could not be verified, and the message says why


# PodResult.reason: the pod said it reset, and its canary was still served from cache
STILL_WARM = "StillWarm"
# PodResult.reason: a warm-up's prompts were answered, and their second send was not served from cache
NOT_WARM = "NotWarm"
# PodResult.reason of a Skipped pod: still starting at the deadline (never Ready since its engine started)
STARTING = "Starting"


@dataclass(slots=True)
class WarmDetail:
    """A warm-up's account of one pod (warmup.py): its prompts, how many were verified warm on every rank,
    and the second sends' token counts, summed."""

    prompts: int
    ranks: int = 1
    warm_prompts: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    block_size: int | None = None  # as the pod named it; None: judged with warmup.UNNAMED_BLOCK
    pin: PinResult | None = None  # None: no pin asked (or not a kvpilot pod)


@dataclass(slots=True)
class PodResult:
    """The result of one target; `result` is PENDING until it is final. The caller updates it in place, so a progress checkpoint sees it move."""

    name: str
    node: str = ""
    ip: str = ""
    result: Outcome = Outcome.PENDING
    http_status: int | None = None  # of the last call; 0: no reply
    attempts: int = 0
    epoch: int | None = None
    evicted_blocks: int | None = None
    message: str = ""
    duration_s: float | None = None
    ranks: list[RankResult] | None = None  # as the pod reported them; None: it reported none
    cleared: list[str] = field(default_factory=list)  # the cache tiers its engine says the reset cleared
    verified: Verified | None = None  # None: not asked
    verify_message: str = ""  # how it was verified, or why it could not be
    reason: str = (
        ""  # a machine-readable cause of a failure (STILL_WARM, NOT_WARM) or a skip (STARTING); else empty
    )
    warm: WarmDetail | None = None  # a warm-up's account of the pod (warmup.py); None for a reset
    target: Target | None = field(default=None, repr=False, compare=False)


def initial_results(targets: Sequence[Target]) -> list[PodResult]:
    """One Pending result per target, sorted by name; targets with a skip reason (or no address) are
    Skipped. What a fan-out starts from, and what a caller shows before the first call."""
    out = []
    for t in sorted(targets, key=lambda t: t.name):
        res = PodResult(t.name, t.node, t.ip, target=t)
        if t.skip_reason or not (t.ip or t.url):
            res.result, res.message = Outcome.SKIPPED, t.skip_reason or "no IP"
        out.append(res)
    return out
