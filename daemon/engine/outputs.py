"""Results the engine hands to its callers, as values."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass(frozen=True, slots=True)
class RequestOutput:
    """What one step produced for one request: the new tokens and, at the end, why it finished."""

    request_id: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None
    num_prompt_tokens: int
    num_cached_tokens: int
    num_output_tokens: int


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

    def to_dict(self) -> dict:
        return asdict(self)


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
    extra: dict = field(default_factory=dict)

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0

    @property
    def usage_ratio(self) -> float:
        return self.blocks_used / self.blocks_total if self.blocks_total else 0.0

    def to_dict(self) -> dict:
        d = asdict(self)
        d["hit_rate"] = self.hit_rate
        d["usage_ratio"] = self.usage_ratio
        return d
