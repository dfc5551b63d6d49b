"""One data-parallel rank: an engine-core process that runs its own `LLMEngine` (own KV cache, own
scheduler) and talks to the API server over two one-way pipes.

Messages in (tuples, first item the kind): `add`, `abort`, `reset`, `stats`, `weights` (a `weight_ops`
operation), `stop`. Messages out: `ready` / `failed` once at start, then `added` (an add's verdict),
`reply` (a reset's, stats' or weight operation's answer: the rank's fields or its `WeightError`),
`step` (one step's outputs and the stats after it), `state` (stats after commands, when no step runs).

A reader thread moves incoming messages into a queue as they arrive, so the server never blocks on a
full pipe while the engine computes; the main thread drains that queue between two steps, so a reset
applies between steps here exactly as in the single-process `EngineLoop`. When the server's end
closes (it died), the reader queues a stop: a rank never outlives its server.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import queue
import signal
import threading
import time
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

from kvpilot.daemon.engine.admission import adapter_for
from kvpilot.daemon.engine.config import EngineConfig
from kvpilot.daemon.engine.kv.publisher import RankEndpoints
from kvpilot.daemon.engine.weights.control import Reply, WeightControl
from kvpilot.daemon.engine.weights.ops import WeightError, WeightErrorKind, WeightOp, beside_steps

if TYPE_CHECKING:
    from kvpilot.daemon.engine.engine import LLMEngine

log = logging.getLogger(__name__)

# A message between the server and a rank: its kind, then the fields that kind carries, as
# `RankWorker._handle` and `DataParallelLoop._on_message` read them (pickled, so of any type).
Message = tuple[Any, ...]

STOP = ("stop",)


@dataclasses.dataclass(frozen=True, slots=True)
class RankInfo:
    """What a ready rank tells the server about itself."""

    rank: int
    pid: int
    model_name: str
    model_dir: str
    max_model_len: int
    num_blocks: int
    vocab_size: int
    kv_events: RankEndpoints | None  # where this rank publishes, as bound; None when events are off


def rank_main(
    rank: int,
    config: EngineConfig,
    inbox: Connection,
    outbox: Connection,
    cpus: list[int] | None,
    log_level: int,
) -> None:
    """The process's entry point (spawned by `DataParallelEngine`)."""
    # Ctrl-C reaches the whole process group; the server decides when ranks stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=log_level, format=f"%(asctime)s %(levelname)s rank{rank} %(name)s: %(message)s")
    if cpus:
        os.sched_setaffinity(0, cpus)
    from kvpilot.daemon.engine.engine import LLMEngine  # after pinning: torch sizes its pools then

    try:
        engine = LLMEngine(config)
    except Exception as exc:  # noqa: BLE001 - reported to the server, which refuses to start
        outbox.send(("failed", f"{type(exc).__name__}: {exc}"))
        return
    pub = engine.kv_events
    events = (
        RankEndpoints(rank, pub.endpoint, pub.replay_endpoint, engine.num_blocks) if pub is not None else None
    )
    outbox.send(
        (
            "ready",
            RankInfo(
                rank,
                os.getpid(),
                engine.model_name,
                str(engine.model_dir),
                engine.max_model_len,
                engine.num_blocks,
                engine.vocab_size,
                events,
            ),
            engine.stats(),
        )
    )
    log.info("rank %d ready (pid %d, cpus %s)", rank, os.getpid(), cpus or "all")
    try:
        RankWorker(rank, engine, inbox, outbox).run()
    except BaseException:
        log.exception("rank %d failed", rank)
        raise


class RankWorker:
    def __init__(self, rank: int, engine: LLMEngine, inbox: Connection, outbox: Connection) -> None:
        self.rank = rank
        self.engine = engine
        self.weights = WeightControl(engine)
        self.outbox = outbox
        self.steps = 0
        self._queue: queue.SimpleQueue[Message] = queue.SimpleQueue()
        threading.Thread(target=self._read, args=(inbox,), name="kvpilot-rank-inbox", daemon=True).start()

    def _read(self, inbox: Connection) -> None:
        while True:
            try:
                msg = inbox.recv()
            except (EOFError, OSError):
                self._queue.put(STOP)
                return
            if msg[0] == "add" and msg[1].lora_name is not None:
                # Its adapter read here, off the engine's thread (as EngineLoop.add does): one let go by
                # --max-cpu-loras is read, hashed and parsed again, which would stall every stream's step.
                try:
                    msg = (*msg, adapter_for(self.engine.loras, msg[1].lora_name))
                except Exception as exc:  # noqa: BLE001 - handed to _handle, which answers the add with it
                    msg = (*msg, exc)
            self._queue.put(msg)

    def run(self) -> None:
        while True:
            busy = self.engine.has_unfinished_requests()
            if not self._drain(block=not busy):
                return
            if not self.engine.has_unfinished_requests():
                self.outbox.send(("state", self.engine.stats(), self.steps, time.time()))
                continue
            outputs = self.engine.step()
            self.steps += 1
            self.outbox.send(("step", outputs, self.engine.stats(), self.steps, time.time()))

    def _drain(self, block: bool) -> bool:
        """Handle every queued message (waiting for one when idle); False on stop."""
        msg = self._queue.get() if block else None
        while True:
            if msg is None:
                try:
                    msg = self._queue.get_nowait()
                except queue.Empty:
                    return True
            if msg[0] == "stop":
                return False
            self._handle(msg)
            msg = None

    def _handle(self, msg: Message) -> None:
        kind = msg[0]
        if kind == "add":
            req = msg[1]  # an EngineRequest
            adapter = msg[2] if len(msg) > 2 else None  # its adapter, or why there is none
            try:
                if isinstance(adapter, Exception):
                    raise adapter
                self.engine.submit(req, adapter)
            except Exception as exc:  # noqa: BLE001 - handed back; the server maps it to a status
                self.outbox.send(("added", req.request_id, describe_error(exc)))
            else:
                self.outbox.send(("added", req.request_id, None))
        elif kind == "abort":
            self.engine.abort_request(msg[1])
        elif kind == "reset":
            _, call_id, reset_running, scope = msg
            try:
                result = self.engine.reset_prefix_cache(reset_running, scope)
            except Exception as exc:  # noqa: BLE001 - the reply names this rank and the error
                log.exception("prefix cache reset failed")
                self.outbox.send(("reply", call_id, None, f"reset failed: {type(exc).__name__}"))
            else:
                self.outbox.send(("reply", call_id, dataclasses.replace(result, rank=self.rank), None))
        elif kind == "unpin":
            _, call_id, scope = msg
            try:
                unpinned = self.engine.unpin_prefixes(scope)
            except Exception as exc:  # noqa: BLE001 - the reply names this rank and the error
                log.exception("unpinning failed")
                self.outbox.send(("reply", call_id, None, f"unpin failed: {type(exc).__name__}"))
            else:
                self.outbox.send(("reply", call_id, unpinned, None))
        elif kind == "stats":
            self.outbox.send(("reply", msg[1], self.engine.stats(), None))
        elif kind == "weights":
            self._weights(*msg[1:])
        elif kind == "weights_done":  # an off-thread operation's reply, sent from this thread
            self.outbox.send(("reply", msg[1], msg[2], None))

    def _weights(self, call_id: int, op: WeightOp) -> None:
        """A weight operation: reading a checkpoint runs on a thread of its own while this one keeps
        stepping; its reply comes back through the queue, so only this thread writes the outbox."""
        weights = self.weights
        if beside_steps(op):

            def work() -> None:
                try:
                    value: Reply = weights.run_beside_steps(op)
                except Exception as exc:  # noqa: BLE001 - answered, not left to the caller's timeout
                    value = WeightError(WeightErrorKind.RANK_FAILED, f"{type(exc).__name__}: {exc}")
                self._queue.put(("weights_done", call_id, value))

            threading.Thread(target=work, name="kvpilot-rank-weights", daemon=True).start()
            return

        def reply(value: Reply) -> None:
            self.outbox.send(("reply", call_id, value, None))

        outputs, value = weights.run(op, reply)
        if outputs:
            self.outbox.send(("step", outputs, self.engine.stats(), self.steps, time.time()))
        if value is not None:
            reply(value)


def describe_error(exc: Exception) -> tuple[str, str, str | None, str | None]:
    """An add's failure as plain values (exceptions with extra fields do not survive pickling)."""
    return type(exc).__name__, str(exc), getattr(exc, "param", None), getattr(exc, "code", None)
