"""Results the engine hands to its callers, as values."""

from __future__ import annotations

from dataclasses import asdict, dataclass


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
