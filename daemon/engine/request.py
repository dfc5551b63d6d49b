"""A request as the engine sees it: token ids, sampling parameters and progress.

One API request becomes one group of `SamplingParams.n` sequences (`n`, or `best_of` when larger) that
share the prompt: each sequence is a `Request`. The first (`index` 0) computes the prompt; the others
wait in its `forks` and branch off when it samples its first token, sharing its KV blocks.
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvpilot.daemon.engine.kv.cache_scope import CacheScope
from kvpilot.daemon.engine.outputs import TokenLogprob
from kvpilot.daemon.engine.weights.lora import LoRAAdapter
from kvpilot.kv.block_keys import DEFAULT_KEYS, BlockHash, KeyScheme
from kvpilot.protocol.limits import MAX_LOGPROBS, MAX_SEQUENCES, MAX_STOP_TOKEN_IDS
from kvpilot.protocol.pins import PinResult

if TYPE_CHECKING:  # client.py imports this module for SamplingParams
    from kvpilot.daemon.engine.client import EngineRequest
    from kvpilot.daemon.kv_transfer.held import HeldSummary
    from kvpilot.daemon.kv_transfer.remote import RemoteBlocks

# Below this temperature the scaled logits overflow; such a temperature means greedy anyway (as in vLLM).
GREEDY_BELOW_TEMPERATURE = 1e-5


class SamplingError(ValueError):
    """A sampling parameter is out of range (the server turns this into a 400)."""


@dataclass(slots=True)
class SamplingParams:
    max_tokens: int = 16  # 0 only with prompt_logprobs: score the prompt, generate nothing
    temperature: float = 0.0  # below GREEDY_BELOW_TEMPERATURE: greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 means no top-k
    min_p: float = 0.0
    repetition_penalty: float = 1.0  # > 1 discourages tokens already in the prompt or the output
    min_tokens: int = 0  # EOS and stop_token_ids cannot end the output before this many tokens
    seed: int | None = None  # sequence i of a group uses seed + i
    stop_token_ids: frozenset[int] = frozenset()
    ignore_eos: bool = False
    n: int = 1  # sequences that share the prompt
    logprobs: int | None = None  # per output token: its logprob and the `logprobs` most likely ones
    prompt_logprobs: int | None = None  # the same for every prompt token after the first

    def validate(self) -> None:
        if self.max_tokens < 0 or (self.max_tokens == 0 and self.prompt_logprobs is None):
            raise SamplingError("max_tokens must be at least 1 (0 only to score the prompt)")
        if not 0.0 <= self.temperature <= 100.0:
            raise SamplingError("temperature must be between 0 and 100")
        if not 0.0 < self.top_p <= 1.0:
            raise SamplingError("top_p must be in (0, 1]")
        if self.top_k < 0:
            raise SamplingError("top_k must be 0 (off) or positive")
        if not 0.0 <= self.min_p <= 1.0:
            raise SamplingError("min_p must be in [0, 1]")
        if not 0.0 < self.repetition_penalty <= 100.0:
            raise SamplingError("repetition_penalty must be in (0, 100]")
        if not 0 <= self.min_tokens <= max(self.max_tokens, 0):
            raise SamplingError("min_tokens must be between 0 and max_tokens")
        if self.seed is not None and not -(2**63) <= self.seed < 2**64:
            raise SamplingError("seed must fit in 64 bits")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise SamplingError(f"at most {MAX_STOP_TOKEN_IDS} stop_token_ids")
        if not 1 <= self.n <= MAX_SEQUENCES:
            raise SamplingError(f"n and best_of must be between 1 and {MAX_SEQUENCES}")
        if self.n > 1 and self.max_tokens == 0:
            raise SamplingError("n > 1 needs max_tokens of at least 1")
        for k in (self.logprobs, self.prompt_logprobs):
            if k is not None and not 0 <= k <= MAX_LOGPROBS:
                raise SamplingError(f"logprobs must be between 0 and {MAX_LOGPROBS}")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW_TEMPERATURE or self.top_k == 1

    def seed_of(self, index: int) -> int | None:
        """Sequence `index`'s own seed: seeded choices differ from each other and still reproduce."""
        return None if self.seed is None else (self.seed + index) % 2**64


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(slots=True, eq=False)
class Request:
    request_id: str  # unique per sequence
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_ids: frozenset[int] = frozenset()
    cache_salt: str | None = None
    # The weights' version key (None: the unnamed initial weights): part of the first block's key, so
    # KV computed by other weights never matches.
    weight_key: str | None = None
    keys: KeyScheme = DEFAULT_KEYS  # how the engine keys blocks (--prefix-caching-hash-algo)
    lora: LoRAAdapter | None = None  # the adapter it runs under; its identity is part of the first key
    group_id: str = ""  # the caller's request id, shared by the sequences of one group
    index: int = 0  # this sequence's place in its group
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    all_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    # Prompt tokens found in the prefix cache when first scheduled (reported as usage.cached_tokens).
    num_cached_tokens: int = -1
    # Keys of this request's full blocks, extended as tokens are appended; computed once per block.
    block_hashes: list[BlockHash] = field(default_factory=list)
    num_preemptions: int = 0
    finish_reason: str | None = None
    # Sequences of the group that branch off this one when it samples its first token.
    forks: list[Request] = field(default_factory=list)
    cumulative_logprob: float = 0.0
    # Prompt logprobs by position (position 0 has none); filled as prefill chunks run.
    prompt_logprobs: list[TokenLogprob | None] | None = None
    # Logprobs of the tokens sampled since the last output.
    new_logprobs: list[TokenLogprob] = field(default_factory=list)
    pin_prefix: bool = False  # pin the prompt's full blocks when it ends (one sequence of a group asks)
    pinned: PinResult | None = None  # what that pin got
    # Prefill/decode disaggregation (kv_transfer/): the id to hold the prompt's KV under for a remote
    # decode when it ends, what that hold holds, and the blocks pulled from a prefill pod to land.
    kv_hold: str | None = None
    held: HeldSummary | None = None
    remote_kv: RemoteBlocks | None = None

    def __post_init__(self) -> None:
        self.all_token_ids = list(self.prompt_token_ids)
        self.group_id = self.group_id or self.request_id
        if self.params.prompt_logprobs is not None:
            self.prompt_logprobs = [None] * len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def stop_ids_blocked(self) -> bool:
        """EOS and stop ids may not end the output yet (min_tokens)."""
        return len(self.output_token_ids) < self.params.min_tokens

    @property
    def cache_scope(self) -> CacheScope:
        """What its blocks' keys fold in besides the tokens: the prefix index they go to."""
        return CacheScope(
            self.weight_key, self.lora.identity if self.lora is not None else None, self.cache_salt
        )

    def update_block_hashes(self, block_size: int) -> None:
        if len(self.all_token_ids) // block_size > len(self.block_hashes):
            lora = self.lora.identity if self.lora is not None else None
            first_extra = self.keys.first_extra(self.cache_salt, self.weight_key, lora)
            self.keys.extend(self.block_hashes, self.all_token_ids, block_size, first_extra)

    def append_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def check_stop(self, max_model_len: int) -> str | None:
        """The finish reason once the last appended token ends the request, else None."""
        if not self.output_token_ids:  # max_tokens 0: the prompt is scored, nothing is generated
            return "length"
        last = self.output_token_ids[-1]
        if not self.stop_ids_blocked:
            if not self.params.ignore_eos and last in self.eos_token_ids:
                return "stop"
            if last in self.params.stop_token_ids:
                return "stop"
        if len(self.output_token_ids) >= self.params.max_tokens or self.num_tokens >= max_model_len:
            return "length"
        return None


def new_group(
    req: EngineRequest,
    eos_token_ids: frozenset[int],
    *,
    weight_key: str | None,
    keys: KeyScheme,
    lora: LoRAAdapter | None,
) -> list[Request]:
    """One API request's `params.n` sequences: they share the prompt (the first one scores its logprobs
    for all) and fork off the first when it samples its first token; each draws with its own seed."""
    params = req.params
    seqs = [
        Request(
            req.request_id if params.n == 1 else f"{req.request_id}#{i}",
            list(req.prompt_token_ids),
            dataclasses.replace(params, seed=params.seed_of(i)),
            eos_token_ids,
            req.cache_salt,
            group_id=req.request_id,
            index=i,
            weight_key=weight_key,
            keys=keys,
            lora=lora,
        )
        for i in range(params.n)
    ]
    seqs[0].pin_prefix = req.pin_prefix  # the prompt's blocks are shared: the first sequence pins them
    seqs[0].kv_hold, seqs[0].remote_kv = req.kv_hold, req.remote_kv  # one sequence (the server checks n)
    for follower in seqs[1:]:
        follower.prompt_logprobs = None  # the first sequence scores the prompt for all
    seqs[0].forks = seqs[1:]
    return seqs


class RequestGroups:
    """The requests in an engine by id (running, waiting or held by a pause alike): each one's sequences,
    and the request as it was added, which is what a weight swap starts again."""

    def __init__(self) -> None:
        self._seqs: dict[str, list[Request]] = {}
        self._added: dict[str, EngineRequest] = {}

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._seqs

    def add(self, req: EngineRequest, seqs: list[Request]) -> None:
        self._seqs[req.request_id] = seqs
        self._added[req.request_id] = req

    def get(self, request_id: str) -> list[Request]:
        return self._seqs.get(request_id, [])

    def added(self, request_id: str) -> EngineRequest | None:
        return self._added.get(request_id)

    def ids(self) -> list[str]:
        return list(self._seqs)

    def pop(self, request_id: str) -> list[Request] | None:
        self._added.pop(request_id, None)
        return self._seqs.pop(request_id, None)

    def finished(self, seq: Request) -> None:
        """`seq` has ended: its group leaves once every sequence of it has."""
        if all(s.status is RequestStatus.FINISHED for s in self.get(seq.group_id)):
            self.pop(seq.group_id)
