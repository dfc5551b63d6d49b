"""The contract between the HTTP server and the engine: `EngineClient`, `EngineInfo`, `start_engine`.

The server never holds an engine, only a client of one. Two clients implement the contract:
`EngineLoop` (`engine_loop.py`: one `LLMEngine` on a thread of the server's process) and
`DataParallelLoop` (`dp_engine.py`: N rank processes). `start_engine` picks one for the config, so the
server never asks which kind it has.

Errors are part of the contract: `add` raises the engine's `RequestRejected` or `SamplingError` (both
`ValueError`, the client's fault) and `QueueFull` (try again later); every call raises
`EngineDeadError` once the client no longer runs. A weight operation answers per rank: a `RankReply`
with the rank's fields or its `WeightError` (`weights/ops.py`).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from kvpilot.daemon.engine.config import EngineConfig
from kvpilot.daemon.engine.outputs import CacheStats, RequestOutput, ResetResult
from kvpilot.daemon.engine.request import SamplingParams
from kvpilot.daemon.engine.weights.ops import (
    AbortRequests,
    Command,
    FinishUpdate,
    InitTransfer,
    LoadLoRA,
    Pause,
    PauseMode,
    RankReply,
    SetVersion,
    UnloadLoRA,
    UpdateWeights,
    WeightOp,
)
from kvpilot.kv.block_keys import BlockHash
from kvpilot.kv.reset_scope import ResetScope

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from kvpilot.daemon.engine.weights.lora import ServedAdapter
    from kvpilot.daemon.kv_transfer.connector import KVConnector
    from kvpilot.daemon.kv_transfer.remote import PullPlan, RemoteBlocks

log = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine has stopped (engine error, a dead rank, or shutdown); it will not answer."""


# What `add` returns: the outputs of a request's sequences as they come, and the error if the engine dies.
OutputQueue = asyncio.Queue[RequestOutput | EngineDeadError]


@dataclass(frozen=True, slots=True)
class EngineInfo:
    """What the server needs to know about the engine it serves, fixed once the model is loaded."""

    model_name: str
    max_model_len: int  # the context every rank can hold
    tokenizer: PreTrainedTokenizerBase
    enable_prefix_caching: bool
    block_size: int
    num_blocks: int  # KV blocks, all ranks together
    num_ranks: int = 1
    weight_version: str = "initial"  # the weights loaded at start (`--weight-version`)
    enable_lora: bool = False  # --enable-lora: adapters may be named, loaded and unloaded
    lora_adapters: dict[str, ServedAdapter] = field(default_factory=dict)  # the adapters served at start
    eviction_policy: str = "lru"  # --prefix-cache-eviction-policy
    pinned_prefix_cap_ratio: float | None = None  # --pinned-prefix-cap-ratio; None: pinning is off


@dataclass(frozen=True, slots=True)
class EngineRequest:
    """One request as the server hands it to the engine: `params.n` sequences sharing the prompt."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    cache_salt: str | None = None
    # The rank to run on (X-data-parallel-rank, checked against `EngineInfo.num_ranks` by the server);
    # None: the engine client chooses.
    data_parallel_rank: int | None = None
    restartable: bool = False  # not streamed: a weight swap may start it again (weights/control.py)
    weight_version: str | None = None  # the weights it must run on (409 weight_version_mismatch)
    lora_name: str | None = None  # the adapter it runs under (--lora-modules); None: the base model
    pin_prefix: bool = False  # pin its prompt's full blocks once computed (--enable-pinned-prefix)
    # Disaggregation (kv_transfer/): hold the prompt's KV under this id for a remote decode (a producer's
    # prefill); blocks pulled from a prefill pod to land before computing (a consumer's decode).
    kv_hold: str | None = None
    remote_kv: RemoteBlocks | None = None


@dataclass(slots=True)
class LoopState:
    """What one rank last published for lock-free readers (metrics scrapes): replaced, never mutated."""

    stats: CacheStats | None = None
    steps: int = 0
    last_step_time: float = 0.0


class WeightOperations(Protocol):
    """The weight operations of an engine client, by name (vLLM's `pause_generation`, ...), each on every
    rank: one `RankReply` per rank, a failed one for a rank that errs, is dead (`RANK_FAILED`) or does not
    answer within `timeout` (`TIMEOUT`). Both clients inherit these and carry an operation to their
    ranks in `run_weight_op`."""

    async def run_weight_op(self, op: WeightOp, timeout: float) -> list[RankReply]:
        """`op` on every rank."""
        raise NotImplementedError

    async def pause_generation(self, mode: PauseMode, timeout: float) -> list[RankReply]:
        return await self.run_weight_op(Pause(mode), timeout)

    async def resume_generation(self, timeout: float) -> list[RankReply]:
        return await self.run_weight_op(Command.RESUME, timeout)

    async def is_paused(self, timeout: float) -> list[RankReply]:
        return await self.run_weight_op(Command.IS_PAUSED, timeout)

    async def abort_requests(self, request_ids: tuple[str, ...], timeout: float) -> list[RankReply]:
        """Abort these requests (none named: all), each where it runs."""
        return await self.run_weight_op(AbortRequests(request_ids), timeout)

    async def init_weight_transfer(self, init_info: dict[str, Any], timeout: float) -> list[RankReply]:
        return await self.run_weight_op(InitTransfer(init_info), timeout)

    async def shutdown_weight_transfer(self, timeout: float) -> list[RankReply]:
        return await self.run_weight_op(Command.SHUTDOWN_TRANSFER, timeout)

    async def start_weight_update(self, timeout: float) -> list[RankReply]:
        return await self.run_weight_op(Command.START_UPDATE, timeout)

    async def update_weights(self, update_info: dict[str, Any], timeout: float) -> list[RankReply]:
        return await self.run_weight_op(UpdateWeights(update_info), timeout)

    async def finish_weight_update(self, version: str | None, timeout: float) -> list[RankReply]:
        return await self.run_weight_op(FinishUpdate(version), timeout)

    async def abort_weight_update(self, timeout: float) -> list[RankReply]:
        return await self.run_weight_op(Command.ABORT_UPDATE, timeout)

    async def update_weight_version(self, version: str, timeout: float) -> list[RankReply]:
        return await self.run_weight_op(SetVersion(version), timeout)

    async def weight_info(self, timeout: float) -> list[RankReply]:
        return await self.run_weight_op(Command.GET_INFO, timeout)

    async def load_lora_adapter(self, name: str, path: str, inplace: bool, timeout: float) -> list[RankReply]:
        return await self.run_weight_op(LoadLoRA(name, path, inplace), timeout)

    async def unload_lora_adapter(self, name: str, timeout: float) -> list[RankReply]:
        return await self.run_weight_op(UnloadLoRA(name), timeout)


class EngineClient(WeightOperations, Protocol):
    """The engine as the server drives it. Create it off the event loop (it loads the model), then
    `start()` it on the event loop that will call it."""

    @property
    def info(self) -> EngineInfo: ...

    def start(self) -> None:
        """Start serving; bound to the running event loop from then on."""

    async def stop(self) -> None:
        """Stop after the current step, fail what is still open, and release the engine (its threads,
        processes and sockets). Safe to call when `start` never ran."""

    @property
    def alive(self) -> bool:
        """Started, and every rank running."""

    @property
    def error(self) -> str | None:
        """Why it is not alive, once it died (None while starting or running)."""

    async def add(self, request: EngineRequest) -> OutputQueue:
        """Queue a request; returns, once the engine accepted it, the queue that yields the
        `RequestOutput`s of all its sequences (or an `EngineDeadError` if the engine dies meanwhile)."""

    def abort(self, request_id: str) -> None:
        """Fire and forget: the request's blocks are freed before the engine's next step."""

    def rank_states(self) -> list[LoopState]:
        """Each rank's latest published state, without waiting for a step (for metrics)."""

    async def rank_stats(self) -> list[CacheStats]:
        """Each rank's stats, read between two of its steps."""

    async def reset_ranks(
        self, reset_running_requests: bool, timeout: float, scope: ResetScope | None = None
    ) -> list[ResetResult]:
        """Reset every rank's prefix cache (or `scope`'s part of it) between two of its steps: one
        result per rank, a failed one for a rank that errs or does not answer within `timeout`."""

    async def unpin_ranks(self, timeout: float, scope: ResetScope | None = None) -> list[RankReply]:
        """Let go of every rank's pinned blocks (or `scope`'s) between two of its steps: one reply per
        rank, `{"unpinned_blocks": n}` or the error of a rank that errs or does not answer in time."""

    def describe_kv_events(self, reached_host: str | None) -> dict[str, Any] | None:
        """Where KV events are published (`GET /kv_events`), None when they are off."""

    @property
    def kv_connector(self) -> KVConnector | None:
        """Prefill/decode disaggregation's side of the engine (--kv-transfer-config), None when off."""

    async def plan_pull(self, request: EngineRequest, remote_keys: list[BlockHash]) -> PullPlan:
        """Which of a prefill pod's held blocks (`remote_keys`, the prompt's order) the request should
        pull: those past what this engine's pool holds, read between two steps. Only with a connector."""

    def mark_unhealthy(self, reason: str) -> None:
        """Stop serving for good (not `alive`, `error` = reason): the ranks may hold mixed weights."""


def start_engine(config: EngineConfig) -> EngineClient:
    """Load the model (on `config.data_parallel_size` rank processes when above 1 or with
    `config.engine_process`) and return its client, not started yet. Raises ValueError, FileNotFoundError or RuntimeError when the engine cannot start."""
    # Imported here: both implementations import this module for the contract's types.
    client: EngineClient
    if config.data_parallel_size > 1 or config.engine_process:
        from kvpilot.daemon.engine.parallel.dp_engine import DataParallelEngine, DataParallelLoop

        client = DataParallelLoop(DataParallelEngine(config, config.data_parallel_size))
    else:
        from kvpilot.daemon.engine.engine import LLMEngine
        from kvpilot.daemon.engine.engine_loop import EngineLoop

        client = EngineLoop(LLMEngine(config))
    info = client.info
    log.info(
        "loaded %s on %d rank(s): %d KV blocks x %d tokens, max_model_len %d, prefix caching %s, "
        "max_num_seqs %d",
        info.model_name,
        info.num_ranks,
        info.num_blocks,
        info.block_size,
        info.max_model_len,
        "on" if info.enable_prefix_caching else "off",
        config.max_num_seqs,
    )
    return client
