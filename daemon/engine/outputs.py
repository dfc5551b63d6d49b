"""Results the engine hands to its callers, as values."""

from __future__ import annotations

import dataclasses
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from kvpilot.protocol.pins import PinResult

if TYPE_CHECKING:
    from kvpilot.daemon.kv_transfer.held import HeldSummary


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """A token's log-probability (fp32, from the logits the sampler saw, before any sampling
    parameter reshaped them) and the `k` most likely tokens at its position, most likely first."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True, slots=True)
class RequestOutput:
    """What one step produced for one sequence: the new tokens and, at the end, why it finished.

    `request_id` is the caller's id; `index` tells the sequences of one request (n > 1) apart.
    """

    request_id: str
    index: int
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None
    num_prompt_tokens: int
    num_cached_tokens: int
    num_output_tokens: int
    logprobs: list[TokenLogprob] | None = None  # of new_token_ids, when asked for
    prompt_logprobs: list[TokenLogprob | None] | None = None  # once, with the first output
    cumulative_logprob: float = 0.0
    weight_version: str | None = None  # the weights that computed these tokens
    # A weight swap starts this sequence again from its prompt: drop what it produced so far.
    restart: bool = False
    pin: PinResult | None = None  # a request that asked `pin_prefix`: what it got, from its first token on
    held: HeldSummary | None = None  # a prefill for a remote decode: what its last output left held


@dataclass(frozen=True, slots=True)
class ResetResult:
    """The honest answer of one prefix-cache reset on one engine (one rank)."""

    success: bool
    epoch: int
    evicted_blocks: int
    in_flight_requests: int
    preempted_requests: int
    duration_ms: float
    rank: int = 0
    error: str | None = None
    # The blocks the reset made unreachable in each tier: "pool" (= evicted_blocks), and "host" and
    # "disk" when those offload tiers are on.
    evicted_by_tier: dict[str, int] = field(default_factory=dict)
    scope: dict[str, str] | None = None  # what a scoped reset named (kvpilot.kv.reset_scope.ResetScope)
    unpinned_blocks: int = 0  # pinned blocks the reset dropped (cold means cold: pins go too)
    dropped_holds: int | None = (
        None  # a producer's prefills held for remote decodes it dropped (None: no holds)
    )

    @classmethod
    def failed(cls, rank: int, error: str) -> ResetResult:
        return cls(False, -1, 0, 0, 0, 0.0, rank=rank, error=error)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True, slots=True)
class TierStats:
    """One offload tier's contents and counters (the pool's own are CacheStats' block counts)."""

    tier: str
    blocks: int
    bytes: int
    capacity_bytes: int
    hit_tokens: int  # prompt tokens served from this tier (copied back instead of computed)
    stored_blocks: int  # blocks written into it, since start
    loaded_blocks: int  # blocks copied back from it into the pool, since start

    @staticmethod
    def total(ranks: list[tuple[TierStats, ...]]) -> tuple[TierStats, ...]:
        """The same tier of every data-parallel rank, summed."""
        counts = [f.name for f in dataclasses.fields(TierStats)][1:]
        return tuple(
            TierStats(same[0].tier, *(sum(getattr(s, name) for s in same) for name in counts))
            for same in zip(*ranks)
        )


@dataclass(frozen=True, slots=True)
class CacheStats:
    epoch: int
    block_size: int
    blocks_total: int
    blocks_free: int
    blocks_cached: int
    blocks_used: int
    query_tokens: int
    hit_tokens: int
    resets: int
    last_reset_time: float | None
    num_running: int
    num_waiting: int
    num_preemptions: int
    offload: tuple[TierStats, ...] = ()  # the tiers below the pool (kv/offload.py), when on
    max_loras: int = 0  # distinct LoRA adapters one step may run (0: LoRA is off)
    lora_running: tuple[str, ...] = ()  # the adapters of the running requests, sorted
    lora_waiting: tuple[str, ...] = ()  # and of the waiting ones
    lora_reloads: int = 0  # adapters read again from disk after --max-cpu-loras let them go (thrash)
    pinned_blocks: int = 0  # blocks pinned by requests' pin_prefix (never evicted)
    pinned_blocks_cap: int = 0  # at most this many (0: pinning is off)
    pins_refused: int = 0  # requests whose pin_prefix was refused (the cap), since start
    eviction_policy: str = "lru"  # which cached block an allocation evicts first

    @classmethod
    def total(cls, ranks: list[CacheStats]) -> CacheStats:
        """All data-parallel ranks as one cache: counts add up; the epoch, reset count and last reset
        time are those every rank has reached (the oldest)."""
        resets = [s.last_reset_time for s in ranks]
        return cls(
            epoch=min(s.epoch for s in ranks),
            block_size=ranks[0].block_size,
            blocks_total=sum(s.blocks_total for s in ranks),
            blocks_free=sum(s.blocks_free for s in ranks),
            blocks_cached=sum(s.blocks_cached for s in ranks),
            blocks_used=sum(s.blocks_used for s in ranks),
            query_tokens=sum(s.query_tokens for s in ranks),
            hit_tokens=sum(s.hit_tokens for s in ranks),
            resets=min(s.resets for s in ranks),
            last_reset_time=None if None in resets else min(r for r in resets if r is not None),
            num_running=sum(s.num_running for s in ranks),
            num_waiting=sum(s.num_waiting for s in ranks),
            num_preemptions=sum(s.num_preemptions for s in ranks),
            offload=TierStats.total([s.offload for s in ranks]),
            max_loras=ranks[0].max_loras,
            lora_running=tuple(sorted({n for s in ranks for n in s.lora_running})),
            lora_waiting=tuple(sorted({n for s in ranks for n in s.lora_waiting})),
            lora_reloads=sum(s.lora_reloads for s in ranks),
            pinned_blocks=sum(s.pinned_blocks for s in ranks),
            pinned_blocks_cap=sum(s.pinned_blocks_cap for s in ranks),
            pins_refused=sum(s.pins_refused for s in ranks),
            eviction_policy=ranks[0].eviction_policy,
        )

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0

    @property
    def usage_ratio(self) -> float:
        return self.blocks_used / self.blocks_total if self.blocks_total else 0.0

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["hit_rate"] = self.hit_rate
        d["usage_ratio"] = self.usage_ratio
        return d
