"""Drive the synchronous engine from an asyncio server: one dedicated thread, one command queue. This is
the `EngineClient` (`client.py`) of a single engine.

Why a thread (and not the event loop, nor a process):
- `LLMEngine.step()` takes tens of milliseconds to seconds; on the event loop it would stall every
  connection (health checks, metrics scrapes, SSE writes) for that long.
- The model's time is spent in torch ops, which release the GIL, so the event loop keeps running while
  the engine thread computes. (Tokenizing and detokenizing run in the server's own small thread pool.)
- A separate process would need its own copy of the model and the KV pool (or shared memory) and IPC
  for every token; for one engine per daemon a thread gives the same isolation from the loop for free.

The engine is not thread-safe, so *every* engine call happens on that thread. The server talks to it
only through commands (add, abort, call) that the thread drains between two steps. A reset or a stats
query is therefore atomic with respect to scheduling: no step can run between its check and its act.

Outputs flow back per request (all its sequences) through one `asyncio.Queue`, fed in one
`call_soon_threadsafe` per step.
If the engine raises, the loop marks itself dead, fails every open request and pending command with
`EngineDeadError` (the server answers 500/503) and stops: nothing waits forever on a dead engine.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from kvpilot.daemon.engine.admission import adapter_for
from kvpilot.daemon.engine.client import (
    EngineDeadError,
    EngineInfo,
    EngineRequest,
    LoopState,
    OutputQueue,
    WeightOperations,
)
from kvpilot.daemon.engine.outputs import CacheStats, RequestOutput, ResetResult
from kvpilot.daemon.engine.weights.control import Reply, WeightControl
from kvpilot.daemon.engine.weights.lora import LoRAAdapter, ServedAdapter
from kvpilot.daemon.engine.weights.ops import RankReply, WeightOp, beside_steps
from kvpilot.kv.reset_scope import ResetScope

if TYPE_CHECKING:
    from kvpilot.daemon.engine.engine import LLMEngine
    from kvpilot.daemon.kv_transfer.connector import KVConnector
    from kvpilot.daemon.kv_transfer.remote import PullPlan
    from kvpilot.kv.block_keys import BlockHash

log = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass(slots=True)
class _Add:
    request: EngineRequest
    sink: OutputQueue
    done: concurrent.futures.Future[None]
    adapter: LoRAAdapter | None  # the adapter it names, with its weights (read off the engine's thread)


@dataclass(slots=True)
class _Abort:
    request_id: str


@dataclass(slots=True)
class _Call(Generic[T]):
    fn: Callable[[Any], T]
    done: concurrent.futures.Future[T]


@dataclass(slots=True)
class _Stop:
    pass


_Command = _Add | _Abort | _Call[Any] | _Stop


@dataclass(slots=True)
class _Open:
    """A request the engine runs: where its outputs go, and how many of its sequences are not finished."""

    sink: OutputQueue
    unfinished: int


class EngineLoop(WeightOperations):
    """The `EngineClient` of one engine: owns the engine thread. `start()` on the event loop, then
    `add`/`abort`/`call`."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.weights = WeightControl(engine)
        self.info = EngineInfo(
            model_name=engine.model_name,
            max_model_len=engine.max_model_len,
            tokenizer=engine.tokenizer,
            enable_prefix_caching=engine.config.enable_prefix_caching,
            block_size=engine.config.block_size,
            num_blocks=engine.num_blocks,
            weight_version=engine.weight_version,
            enable_lora=engine.config.enable_lora,
            lora_adapters={
                n: ServedAdapter(str(path), key.digest) for n, (path, key) in engine.loras.served.items()
            },
            eviction_policy=engine.config.prefix_cache_eviction_policy,
            pinned_prefix_cap_ratio=engine.config.pin_ratio,
        )
        self._loop: asyncio.AbstractEventLoop | None = None  # the event loop outputs go to, once started
        self._commands: queue.SimpleQueue[_Command] = queue.SimpleQueue()
        # request id -> its queue and sequences not finished yet; touched by the engine thread only
        self._sinks: dict[str, _Open] = {}
        self._lock = threading.Lock()  # orders "dead" against submissions, so no command is stranded
        self._dead = False
        self._error: str | None = None
        self._thread = threading.Thread(target=self._run, name="kvpilot-engine", daemon=True)
        self.state = LoopState(stats=engine.stats())

    # ---- lifecycle -----------------------------------------------------------------------------
    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._dead

    @property
    def error(self) -> str | None:
        return self._error

    async def stop(self, timeout: float = 10.0) -> None:
        """Stop after the current step; open requests are failed (the server drains them first). Then
        the engine's own resources (the KV events publisher) are released."""
        if self._thread.ident is not None:  # started
            try:
                self._submit(_Stop())
            except EngineDeadError:
                pass
            await asyncio.get_running_loop().run_in_executor(None, self._thread.join, timeout)
        self.engine.close()

    # ---- API for the event loop ----------------------------------------------------------------
    async def add(self, request: EngineRequest) -> OutputQueue:
        """Queue a request; returns its output queue once the engine accepted it.

        Raises the engine's ValueError (RequestRejected, SamplingError) for bad input and QueueFull when
        too many requests wait. The queue yields the `RequestOutput`s of all `params.n` sequences, and
        an `EngineDeadError` instance if the engine dies meanwhile.
        """
        adapter = None
        if request.lora_name is not None:
            # Off the engine's thread: an adapter --max-cpu-loras let go is read, hashed and parsed again
            # (a 149 MiB one took ~0.5 s), which would stall every stream's step.
            adapter = await asyncio.to_thread(adapter_for, self.engine.loras, request.lora_name)
        sink: OutputQueue = asyncio.Queue()
        done: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._submit(_Add(request, sink, done, adapter))
        try:
            await asyncio.wrap_future(done)
        except asyncio.CancelledError:
            self.abort(request.request_id)  # the client left while we queued: it may have been added anyway
            raise
        return sink

    def abort(self, request_id: str) -> None:
        """Fire and forget: processed before the next step, so its blocks are freed within one step."""
        try:
            self._submit(_Abort(request_id))
        except EngineDeadError:
            pass  # a dead engine holds nothing to free

    async def call(self, fn: Callable[[Any], T]) -> T:
        """Run `fn(engine)` on the engine thread between two steps and return its result."""
        done: concurrent.futures.Future[T] = concurrent.futures.Future()
        self._submit(_Call(fn, done))
        return await asyncio.wrap_future(done)

    # ---- operations, as `DataParallelLoop` offers them over its ranks (here: rank 0 only) ----------
    def rank_states(self) -> list[LoopState]:
        return [self.state]

    async def rank_stats(self) -> list[CacheStats]:
        return [await self.call(lambda engine: engine.stats())]

    async def reset_ranks(
        self, reset_running_requests: bool, timeout: float, scope: ResetScope | None = None
    ) -> list[ResetResult]:
        """The reset between two steps, as one rank's result (a failed one if it errs or times out).
        Raises EngineDeadError when the loop is not running."""
        try:
            reset = self.call(lambda engine: engine.reset_prefix_cache(reset_running_requests, scope))
            return [await asyncio.wait_for(reset, timeout)]
        except EngineDeadError:
            raise
        except TimeoutError:
            return [ResetResult.failed(0, f"no answer within {timeout:g} s")]
        except Exception as exc:  # noqa: BLE001 - reported per rank, honestly, without a stack trace
            log.exception("prefix cache reset failed")
            return [ResetResult.failed(0, f"reset failed: {type(exc).__name__}")]

    async def unpin_ranks(self, timeout: float, scope: ResetScope | None = None) -> list[RankReply]:
        try:
            unpin = self.call(lambda engine: engine.unpin_prefixes(scope))
            return [RankReply(0, value={"unpinned_blocks": await asyncio.wait_for(unpin, timeout)})]
        except EngineDeadError:
            raise
        except Exception as exc:  # noqa: BLE001 - reported per rank (a timeout as TIMEOUT)
            return [RankReply.of(0, exc, timeout)]

    def describe_kv_events(self, reached_host: str | None) -> dict[str, Any] | None:
        publisher = self.engine.kv_events
        return None if publisher is None else publisher.describe(reached_host)

    @property
    def kv_connector(self) -> KVConnector | None:
        return self.engine.connector

    async def plan_pull(self, request: EngineRequest, remote_keys: list[BlockHash]) -> PullPlan:
        return await self.call(lambda engine: engine.plan_pull(request, remote_keys))

    async def run_weight_op(self, op: WeightOp, timeout: float) -> list[RankReply]:
        """A weight operation: reading, hashing and joining beside the steps, the others between two."""
        weights = self.weights
        reply: Reply | TimeoutError
        try:
            if beside_steps(op):
                work = asyncio.get_running_loop().run_in_executor(None, weights.run_beside_steps, op)
            else:
                replied: concurrent.futures.Future[Reply] = concurrent.futures.Future()

                def run(engine: LLMEngine) -> None:
                    outputs, reply = weights.run(op, replied.set_result)
                    if outputs:
                        self._deliver(outputs)
                    if reply is not None:
                        replied.set_result(reply)

                await self.call(run)
                work = asyncio.wrap_future(replied)
            reply = await asyncio.wait_for(work, timeout)
        except TimeoutError as exc:
            reply = exc
        return [RankReply.of(0, reply, timeout)]

    def mark_unhealthy(self, reason: str) -> None:
        with self._lock:
            self._dead, self._error = True, reason

    def _submit(self, cmd: _Command) -> None:
        with self._lock:
            if self._dead:
                raise EngineDeadError(self._error or "the engine loop is not running")
            self._commands.put(cmd)

    # ---- the engine thread ---------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while True:
                # Block for work only when idle; otherwise take what arrived during the last step.
                idle = not self.engine.has_unfinished_requests()
                if not self._drain_commands(block=idle):
                    break
                if not self.engine.has_unfinished_requests():
                    continue
                outputs = self.engine.step()
                self._publish(steps=self.state.steps + 1)
                if outputs:
                    self._deliver(outputs)
        except BaseException as exc:  # noqa: BLE001 - whatever broke, no client may hang on it
            log.exception("engine loop failed; failing all requests")
            self._die(f"engine error: {type(exc).__name__}")
            return
        self._die("the engine loop has stopped")

    def _drain_commands(self, block: bool) -> bool:
        """Run queued commands; False when asked to stop."""
        handled = False
        while True:
            try:
                cmd = (
                    self._commands.get(timeout=1.0) if block and not handled else self._commands.get_nowait()
                )
            except queue.Empty:
                if handled:
                    self._publish()
                return True
            handled = True
            if isinstance(cmd, _Stop):
                return False
            self._handle(cmd)

    def _handle(self, cmd: _Command) -> None:
        if isinstance(cmd, _Add):
            if not cmd.done.set_running_or_notify_cancel():
                return  # the caller gave up before we got to it
            req = cmd.request
            try:
                self.engine.submit(req, cmd.adapter)
            except Exception as exc:  # noqa: BLE001 - handed to the caller, who maps it to a status
                cmd.done.set_exception(exc)
                return
            self._sinks[req.request_id] = _Open(cmd.sink, req.params.n)
            cmd.done.set_result(None)
        elif isinstance(cmd, _Abort):
            if self.engine.abort_request(cmd.request_id):
                self._sinks.pop(cmd.request_id, None)
        elif isinstance(cmd, _Call):
            if cmd.done.set_running_or_notify_cancel():
                try:
                    cmd.done.set_result(cmd.fn(self.engine))
                except Exception as exc:  # noqa: BLE001 - the caller decides what it means
                    cmd.done.set_exception(exc)

    def _publish(self, steps: int | None = None) -> None:
        now = time.time()
        self.state = LoopState(
            stats=self.engine.stats(),
            steps=self.state.steps if steps is None else steps,
            last_step_time=now if steps is not None else self.state.last_step_time,
        )

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        batch: list[tuple[OutputQueue, RequestOutput | EngineDeadError]] = []
        for out in outputs:
            entry = self._sinks.get(out.request_id)
            if entry is None:
                continue
            if out.finished:
                entry.unfinished -= 1
                if entry.unfinished == 0:
                    del self._sinks[out.request_id]
            batch.append((entry.sink, out))
        self._post(_put_all, batch)

    def _post(self, fn: Callable[[T], None], arg: T) -> None:
        assert self._loop is not None  # set by start(), before the thread runs
        try:
            self._loop.call_soon_threadsafe(fn, arg)
        except RuntimeError:
            pass  # the event loop is closed: nobody is listening any more

    def _die(self, reason: str) -> None:
        with self._lock:
            self._dead = True
            self._error = reason
        err = EngineDeadError(reason)
        failed: list[tuple[OutputQueue, RequestOutput | EngineDeadError]] = [
            (entry.sink, err) for entry in self._sinks.values()
        ]
        self._post(_put_all, failed)
        self._sinks.clear()
        while True:  # commands that raced in before `_dead` was set
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                break
            done = getattr(cmd, "done", None)
            if done is not None and not done.done():
                done.set_exception(EngineDeadError(reason))


def _put_all(batch: list[tuple[OutputQueue, RequestOutput | EngineDeadError]]) -> None:
    for sink, item in batch:
        sink.put_nowait(item)
