"""A request as the engine sees it: token ids, sampling parameters and progress."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from kvpilot.daemon.engine.block_hash import BlockHash, extend_block_hashes, salt_key

GREEDY_BELOW_TEMPERATURE = 1e-5


class SamplingError(ValueError):
    """A sampling parameter is out of range (the server turns this into a 400)."""


@dataclass(slots=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 0.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 means no top-k
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def validate(self) -> None:
        if self.max_tokens < 1:
            raise SamplingError("max_tokens must be at least 1")
        if not 0.0 <= self.temperature <= 100.0:
            raise SamplingError("temperature must be between 0 and 100")
        if not 0.0 < self.top_p <= 1.0:
            raise SamplingError("top_p must be in (0, 1]")
        if self.top_k < 0:
            raise SamplingError("top_k must be 0 (off) or positive")
        if self.seed is not None and not -(2**63) <= self.seed < 2**64:
            raise SamplingError("seed must fit in 64 bits")

    @property
    def greedy(self) -> bool:
        # Below 1e-5 the scaled logits overflow; such a temperature means greedy anyway (as in vLLM).
        return self.temperature < GREEDY_BELOW_TEMPERATURE or self.top_k == 1


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(slots=True, eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_ids: tuple[int, ...] = ()
    cache_salt: str | None = None
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    all_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    # Prompt tokens found in the prefix cache when first scheduled (reported as usage.cached_tokens).
    num_cached_tokens: int = -1
    # Keys of this request's full blocks, extended as tokens are appended; computed once per block.
    block_hashes: list[BlockHash] = field(default_factory=list)
    # Index epoch in which this request's KV began; blocks of an older epoch are never indexed.
    cache_epoch: int = -1
    num_preemptions: int = 0
    finish_reason: str | None = None

    def __post_init__(self) -> None:
        self.all_token_ids = list(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def salt_bytes(self) -> bytes:
        return salt_key(self.cache_salt)

    def update_block_hashes(self, block_size: int) -> None:
        extend_block_hashes(self.block_hashes, self.all_token_ids, block_size, self.salt_bytes)

    def append_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def check_stop(self, max_model_len: int) -> str | None:
        """The finish reason once the last appended token ends the request, else None."""
        last = self.output_token_ids[-1]
        if not self.params.ignore_eos and last in self.eos_token_ids:
            return "stop"
        if last in self.params.stop_token_ids:
            return "stop"
        if len(self.output_token_ids) >= self.params.max_tokens or self.num_tokens >= max_model_len:
            return "length"
        return None
