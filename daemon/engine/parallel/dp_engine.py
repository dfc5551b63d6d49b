"""Data parallel: N engine-core processes (`dp_rank.py`) behind one API server.

`DataParallelEngine` starts the ranks and waits until each has loaded the model; `DataParallelLoop`
drives them and is the server's `EngineClient` (`client.py`), as `EngineLoop` is for one engine.
Requests go to a rank by `dp_policy.PrefixAwarePolicy`; outputs come back per rank.

IPC is a pair of one-way `multiprocessing` pipes per rank carrying pickled tuples, not ZeroMQ:
- a rank that dies (crash, OOM kill, SIGKILL) closes its end, so the server's reader sees EOF at once
  and fails that rank's requests; ZeroMQ sockets hide a dead peer and would need heartbeats;
- the messages are the engine's own dataclasses (EngineRequest, RequestOutput, CacheStats), which
  pickle as they are; nothing to keep in step with a second schema, and no extra dependency.
The pipes are local and carry a few hundred bytes per request per step, far from being the bottleneck.

Each rank gets its share of the CPUs (pinned, torch threads = the share) or its own CUDA device (placement.py).
A dead rank makes the loop not `alive` (/health 503); nothing is rerouted: its KV and its requests are
gone, so the pod should restart, which a failing /health brings about.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import multiprocessing
import threading
import time
from dataclasses import dataclass
from typing import Any, cast

from kvpilot.daemon.engine.admission import QueueFull, RequestRejected
from kvpilot.daemon.engine.client import (
    EngineDeadError,
    EngineInfo,
    EngineRequest,
    LoopState,
    OutputQueue,
    WeightOperations,
)
from kvpilot.daemon.engine.config import EngineConfig
from kvpilot.daemon.engine.kv.publisher import describe_ranks
from kvpilot.daemon.engine.loader import resolve_model_dir
from kvpilot.daemon.engine.outputs import CacheStats, ResetResult
from kvpilot.daemon.engine.parallel.dp_policy import PrefixAwarePolicy
from kvpilot.daemon.engine.parallel.dp_rank import Message, RankInfo, rank_main
from kvpilot.daemon.engine.parallel.placement import rank_configs
from kvpilot.daemon.engine.request import SamplingError
from kvpilot.daemon.engine.weights.lora import parse_lora_modules, served_adapter
from kvpilot.daemon.engine.weights.ops import INITIAL_VERSION, FinishUpdate, RankReply, SetVersion, WeightOp
from kvpilot.daemon.kv_transfer.remote import PullPlan
from kvpilot.kv.block_keys import BlockHash, LoRAKey, key_scheme
from kvpilot.kv.events import DEFAULT_BUFFER_BATCHES, DEFAULT_BUFFER_BYTES
from kvpilot.kv.reset_scope import ResetScope

log = logging.getLogger(__name__)

START_TIMEOUT_S = 900.0  # loading a large checkpoint from a slow disk
STOP_TIMEOUT_S = 10.0


@dataclass(slots=True)
class _Open:
    """An open request: the rank running it, where its outputs go, its sequences not finished yet."""

    rank: int
    sink: OutputQueue
    unfinished: int


@dataclass(slots=True)
class _Rank:
    rank: int
    process: multiprocessing.process.BaseProcess
    inbox: Any  # Connection: server -> rank
    outbox: Any  # Connection: rank -> server
    info: RankInfo | None = None
    state: LoopState = dataclasses.field(default_factory=LoopState)
    load: int = 0  # open requests
    dead: str | None = None  # why, once it died


class DataParallelEngine:
    """The ranks, started and loaded, and what the server needs to know about them (`info`)."""

    def __init__(self, config: EngineConfig, size: int) -> None:
        if size < 2 and not config.engine_process:
            raise ValueError("data parallelism needs at least 2 ranks; 1 runs in the server's process")
        config.validate()
        self.config = config
        self.size = size
        # Convert the embedded model once, here, before N ranks would race for its lock.
        model_dir = resolve_model_dir(config.model)
        ctx = multiprocessing.get_context("spawn")
        configs, shares = rank_configs(config, size)
        self.ranks: list[_Rank] = []
        try:
            for r in range(size):
                inbox_r, inbox_w = ctx.Pipe(duplex=False)
                outbox_r, outbox_w = ctx.Pipe(duplex=False)
                args = (r, configs[r], inbox_r, outbox_w, shares[r], logging.getLogger().getEffectiveLevel())
                proc = ctx.Process(target=rank_main, args=args, name=f"kvpilot-rank{r}", daemon=True)
                proc.start()
                inbox_r.close()  # the rank's ends: only the rank may hold them, or EOF never comes
                outbox_w.close()
                self.ranks.append(_Rank(r, proc, inbox_w, outbox_r))
            from transformers import AutoTokenizer  # while the ranks load

            tokenizer = AutoTokenizer.from_pretrained(model_dir)
            for rank in self.ranks:
                self._wait_ready(rank)
        except BaseException:
            self.close()
            raise
        infos = [cast(RankInfo, rank.info) for rank in self.ranks]  # set by _wait_ready
        self.info = EngineInfo(
            model_name=infos[0].model_name,
            max_model_len=min(i.max_model_len for i in infos),
            tokenizer=tokenizer,
            enable_prefix_caching=config.enable_prefix_caching,
            block_size=config.block_size,
            num_blocks=sum(i.num_blocks for i in infos),
            num_ranks=size,
            weight_version=config.weight_version or INITIAL_VERSION,
            enable_lora=config.enable_lora,
            lora_adapters={
                name: served_adapter(name, path)
                for name, path in (
                    parse_lora_modules(config.lora_modules) if config.enable_lora else {}
                ).items()
            },
            eviction_policy=config.prefix_cache_eviction_policy,
            pinned_prefix_cap_ratio=config.pin_ratio,
        )

    def _wait_ready(self, rank: _Rank) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not rank.outbox.poll(1.0):
            if not rank.process.is_alive():
                raise RuntimeError(f"rank {rank.rank} exited with code {rank.process.exitcode} while loading")
            if time.monotonic() > deadline:
                raise RuntimeError(f"rank {rank.rank} did not load within {START_TIMEOUT_S:.0f} s")
        try:
            msg = rank.outbox.recv()
        except EOFError:
            raise RuntimeError(f"rank {rank.rank} exited while loading") from None
        if msg[0] == "failed":
            raise ValueError(f"rank {rank.rank}: {msg[1]}")
        _, rank.info, stats = msg
        rank.state = LoopState(stats=stats)

    def close(self, grace: float = 0.0) -> None:
        """Wait up to `grace` seconds for the ranks to exit, then kill those still running."""
        deadline = time.monotonic() + grace
        for rank in self.ranks:
            rank.process.join(max(0.0, deadline - time.monotonic()))
            if rank.process.is_alive():
                rank.process.kill()
                rank.process.join(STOP_TIMEOUT_S)
            rank.inbox.close()
            rank.outbox.close()


class DataParallelLoop(WeightOperations):
    """The `EngineClient` of the ranks. Everything but the reader threads runs on the event loop, so the
    bookkeeping (open requests, pending replies) needs no lock."""

    def __init__(self, engine: DataParallelEngine) -> None:
        self.engine = engine
        self.info = engine.info
        self._loop: asyncio.AbstractEventLoop | None = None  # the event loop, once started
        self._ranks = engine.ranks
        self._policy = PrefixAwarePolicy(len(self._ranks))
        self._keys = key_scheme(engine.config.prefix_caching_hash_algo)  # the ranks' own, as they derive it
        self._requests: dict[str, _Open] = {}  # by request id
        # add's request id / a call's id -> (rank, its verdict: an add's error or None, a call's reply)
        self._pending: dict[str | int, tuple[int, asyncio.Future[Any]]] = {}
        self._call_ids = itertools.count()
        self._stopping = False
        self._unhealthy: str | None = None  # set when the ranks may hold mixed weights

    # ---- lifecycle -----------------------------------------------------------------------------
    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        for rank in self._ranks:
            threading.Thread(
                target=self._read, args=(rank,), name=f"kvpilot-rank{rank.rank}-outbox", daemon=True
            ).start()

    @property
    def alive(self) -> bool:
        started = self._loop is not None
        healthy = self._unhealthy is None and not self._stopping
        return started and healthy and all(r.dead is None for r in self._ranks)

    @property
    def error(self) -> str | None:
        return "; ".join([*(r.dead for r in self._ranks if r.dead), *filter(None, [self._unhealthy])]) or None

    def mark_unhealthy(self, reason: str) -> None:
        self._unhealthy = reason

    def rank_states(self) -> list[LoopState]:
        return [r.state for r in self._ranks]

    async def stop(self, timeout: float = STOP_TIMEOUT_S) -> None:
        self._stopping = True
        for rank in self._ranks:
            self._send(rank, ("stop",))
        self._fail_open(EngineDeadError("the engine loop has stopped"), None)
        await asyncio.get_running_loop().run_in_executor(None, self.engine.close, timeout)

    # ---- requests ------------------------------------------------------------------------------
    async def add(self, request: EngineRequest) -> OutputQueue:
        if not self.alive:
            raise EngineDeadError(self.error or "the engine loop is not running")
        request_id = request.request_id
        if request_id in self._requests or request_id in self._pending:
            raise RequestRejected(f"request id {request_id!r} is already running", "request_id")
        # Keys of this process's own memory of where prefixes went (dp_policy.py): an adapter's name
        # keeps its prefixes apart from the base model's (its files' digest is the ranks' to know).
        lora = LoRAKey(request.lora_name, "") if request.lora_name is not None else None
        keys = self._keys.prompt_hashes(
            request.prompt_token_ids, self.info.block_size, request.cache_salt, lora=lora
        )
        if request.data_parallel_rank is not None:  # the caller (a router reading our KV events) chose
            rank = self._ranks[request.data_parallel_rank]
            if rank.dead:
                raise EngineDeadError(rank.dead)
            self._policy.remember(rank.rank, keys)
        else:
            alive = [r.rank for r in self._ranks if r.dead is None]
            rank = self._ranks[self._policy.choose(keys, [r.load for r in self._ranks], alive)]
        sink: OutputQueue = asyncio.Queue()
        verdict = asyncio.get_running_loop().create_future()
        self._pending[request_id] = (rank.rank, verdict)
        self._requests[request_id] = _Open(rank.rank, sink, request.params.n)
        rank.load += 1
        self._send(rank, ("add", request))
        try:
            error = await verdict
        except asyncio.CancelledError:
            self.abort(request_id)  # the client left while we queued: it may have been added anyway
            raise
        if error is not None:
            self._close_request(request_id)
            raise _rebuild_error(error)
        return sink

    def abort(self, request_id: str) -> None:
        entry = self._close_request(request_id)
        if entry is not None:
            self._send(self._ranks[entry.rank], ("abort", request_id))

    def _close_request(self, request_id: str) -> _Open | None:
        entry = self._requests.pop(request_id, None)
        if entry is not None:
            self._ranks[entry.rank].load -= 1
        return entry

    # ---- operations ----------------------------------------------------------------------------
    async def rank_stats(self) -> list[CacheStats]:
        """Fresh stats of every rank (a dead rank's last known ones)."""
        replies = await asyncio.gather(*(self._call(r, "stats") for r in self._ranks), return_exceptions=True)
        # a rank's stats are there from its ready message on
        last = [cast(CacheStats, r.state.stats) for r in self._ranks]
        return [s if isinstance(s, CacheStats) else old for s, old in zip(replies, last)]

    async def reset_ranks(
        self, reset_running_requests: bool, timeout: float, scope: ResetScope | None = None
    ) -> list[ResetResult]:
        """Reset every rank between its steps; one result per rank, a failed one for a rank that is
        dead, errs or does not answer within `timeout`."""
        if all(r.dead for r in self._ranks):
            raise EngineDeadError(self.error or "the engine loop is not running")
        replies = await asyncio.gather(
            *(
                asyncio.wait_for(self._call(r, "reset", reset_running_requests, scope), timeout)
                for r in self._ranks
            ),
            return_exceptions=True,
        )
        results = []
        for rank, reply in zip(self._ranks, replies):
            if isinstance(reply, ResetResult):
                # A scoped reset keeps the memory: the other scopes' prefixes are still warm on their
                # rank, and the reset scope's next prompts going back to its rank refill it there.
                if scope is None:
                    self._policy.forget(rank.rank)
                results.append(reply)
            elif isinstance(reply, TimeoutError):
                results.append(ResetResult.failed(rank.rank, f"no answer within {timeout:g} s"))
            else:  # dead (EngineDeadError) or the reset raised there
                results.append(ResetResult.failed(rank.rank, str(reply)))
        return results

    async def unpin_ranks(self, timeout: float, scope: ResetScope | None = None) -> list[RankReply]:
        """Unpin on every rank at once; a rank that is dead or does not answer fails it."""
        if all(r.dead for r in self._ranks):
            raise EngineDeadError(self.error or "the engine loop is not running")
        replies = await asyncio.gather(
            *(asyncio.wait_for(self._call(r, "unpin", scope), timeout) for r in self._ranks),
            return_exceptions=True,
        )
        return [
            RankReply.of(rank.rank, {"unpinned_blocks": reply} if isinstance(reply, int) else reply, timeout)
            for rank, reply in zip(self._ranks, replies)
        ]

    async def run_weight_op(self, op: WeightOp, timeout: float) -> list[RankReply]:
        """The operation on every rank at once; a rank that is dead or does not answer fails it."""
        replies = await asyncio.gather(
            *(asyncio.wait_for(self._call(r, "weights", op), timeout) for r in self._ranks),
            return_exceptions=True,
        )
        out = [RankReply.of(rank.rank, reply, timeout) for rank, reply in zip(self._ranks, replies)]
        if isinstance(op, FinishUpdate | SetVersion):
            for rank in self._ranks:
                self._policy.forget(rank.rank)  # its keys now carry the new version
        return out

    def describe_kv_events(self, reached_host: str | None) -> dict[str, Any] | None:
        ranks = [r.info.kv_events for r in self._ranks if r.info is not None and r.info.kv_events is not None]
        if not ranks:
            return None
        cfg = self.engine.config
        return describe_ranks(
            ranks, reached_host, "", cfg.block_size, DEFAULT_BUFFER_BATCHES, DEFAULT_BUFFER_BYTES, self._keys
        )

    @property
    def kv_connector(self) -> None:
        return None  # config.py refuses --kv-transfer-config with data parallelism

    async def plan_pull(self, request: EngineRequest, remote_keys: list[BlockHash]) -> PullPlan:
        raise RuntimeError("no KV connector with data parallelism")

    async def _call(self, rank: _Rank, kind: str, *args: Any) -> Any:
        if rank.dead:
            raise EngineDeadError(rank.dead)
        call_id = next(self._call_ids)
        reply = asyncio.get_running_loop().create_future()
        self._pending[call_id] = (rank.rank, reply)
        self._send(rank, (kind, call_id, *args))
        try:
            return await reply
        finally:
            self._pending.pop(call_id, None)

    # ---- the wire ------------------------------------------------------------------------------
    def _send(self, rank: _Rank, msg: Message) -> None:
        if rank.dead:
            return
        try:
            rank.inbox.send(msg)
        except (OSError, ValueError) as exc:  # broken pipe: the reader reports the death with its code
            log.debug("rank %d: send failed: %s", rank.rank, exc)

    def _read(self, rank: _Rank) -> None:
        """Reader thread: each message from the rank, handled on the event loop; EOF is its death."""
        while True:
            try:
                msg = rank.outbox.recv()
            except (EOFError, OSError):
                break
            self._post(self._on_message, rank, msg)
        rank.process.join(1.0)
        self._post(self._on_death, rank, rank.process.exitcode)

    def _post(self, fn: Any, *args: Any) -> None:
        assert self._loop is not None  # set by start(), before the reader threads run
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:
            pass  # the event loop is closed: nobody is listening any more

    def _on_message(self, rank: _Rank, msg: Message) -> None:
        kind = msg[0]
        if kind == "step":
            _, outputs, stats, steps, when = msg
            rank.state = LoopState(stats=stats, steps=steps, last_step_time=when)
            for out in outputs:
                entry = self._requests.get(out.request_id)
                if entry is None or entry.rank != rank.rank:
                    continue  # aborted meanwhile
                entry.sink.put_nowait(out)
                if out.finished:
                    entry.unfinished -= 1
                    if entry.unfinished == 0:
                        self._close_request(out.request_id)
        elif kind == "state":
            _, stats, steps, when = msg
            rank.state = LoopState(stats=stats, steps=steps, last_step_time=rank.state.last_step_time)
        elif kind == "added":
            self._settle(msg[1], msg[2])
        elif kind == "reply":
            _, call_id, value, error = msg
            if error is None:
                self._settle(call_id, value)
            else:
                self._settle(call_id, exception=RuntimeError(error))

    def _settle(self, key: Any, value: Any = None, exception: BaseException | None = None) -> None:
        pending = self._pending.pop(key, None)
        if pending is None or pending[1].done():
            return
        if exception is not None:
            pending[1].set_exception(exception)
        else:
            pending[1].set_result(value)

    def _on_death(self, rank: _Rank, exitcode: int | None) -> None:
        if self._stopping:
            return
        rank.dead = f"rank {rank.rank} died (exit code {exitcode})"
        log.error("%s; failing its requests", rank.dead)
        self._fail_open(EngineDeadError(rank.dead), rank.rank)

    def _fail_open(self, err: EngineDeadError, rank: int | None) -> None:
        """Fail the open requests and pending replies of one rank (or all)."""
        for rid, entry in list(self._requests.items()):
            if rank is None or entry.rank == rank:
                entry.sink.put_nowait(err)
                self._close_request(rid)
        for key, (r, fut) in list(self._pending.items()):
            if (rank is None or r == rank) and not fut.done():
                fut.set_exception(err)
                self._pending.pop(key, None)


def _rebuild_error(error: tuple[str, str, str | None, str | None]) -> Exception:
    kind, message, param, code = error
    if kind == "QueueFull":
        return QueueFull(message)
    if kind == "RequestRejected":
        return RequestRejected(message, param, code)
    if kind == "SamplingError":
        return SamplingError(message)
    return RuntimeError(f"{kind}: {message}")
