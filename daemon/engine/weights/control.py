"""One engine's side of a weight update: the stage, the swap, the version; and the dispatch of every weight
operation (`weights/ops.py`) to its handler.

`WeightControl` belongs to an `LLMEngine` (one per data-parallel rank); its client (`EngineLoop`, a rank's
`RankWorker`) makes it and hands it each operation:
- `run(op)`: on the engine thread between two steps (pause, resume, start, finish, ...). It returns
  the outputs to deliver (requests ended or restarted by the operation) and the reply, or no reply yet
  when the pause waits for a drain: `on_reply` gets it after the step that drained the batch.
- `run_beside_steps(op)`: `UpdateWeights`, `Command.GET_INFO` and `InitTransfer`, which read a
  checkpoint, hash the weights or join a trainer's group for up to seconds; they run beside the steps
  and touch only the stage (the live weights are read, never written: `_lock` keeps a swap from racing a digest).
A reply is the rank's fields for the route's `ranks`, or the `WeightError` that refused the operation.

The pause modes, the requests and the version are the engine's (`LLMEngine.pause`, `swap_weights`,
`set_weight_version`). The swap (`finish`) copies the stage into the live parameters and starts a cache
generation: the prefix index is reset (epoch + 1, `AllBlocksCleared` with the version) and the version
becomes part of every new block key, so KV computed by other weights can never match, whether or not
anyone resets later. Requests still in the engine follow the pause mode; frozen ones (`keep`, or a finish
without a pause) are recomputed from their prompt with the new weights, so every response comes from one
version: a non-streamed one restarts (its outputs so far are discarded, `RequestOutput.restart`), a stream
that has already sent tokens cannot take them back and ends with finish_reason "abort".
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from kvpilot.daemon.engine.outputs import RequestOutput
from kvpilot.daemon.engine.weights import ops
from kvpilot.daemon.engine.weights.lora import LoRAError
from kvpilot.daemon.engine.weights.ops import INITIAL_VERSION, WeightError, WeightErrorKind
from kvpilot.daemon.engine.weights.stage import WeightStage, checkpoint_tensors, weights_digest

if TYPE_CHECKING:
    from kvpilot.daemon.engine.engine import LLMEngine

log = logging.getLogger(__name__)

Reply = dict[str, Any] | WeightError
Done = tuple[list[RequestOutput], Reply | None]


class WeightControl:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.updates = 0
        self._digest: str | None = None
        self._stage: WeightStage | None = None
        self._staged_digest: str | None = None
        self._busy = False  # an update is reading into the stage
        self._receiver: Any = None  # the gloo transport's group, once initialized
        self._lock = threading.Lock()

    # ---- the dispatch --------------------------------------------------------------------------
    def run(self, op: ops.WeightOp, on_reply: Callable[[Reply], None]) -> Done:
        """Run `op` between two steps; returns the outputs to deliver and the reply (None: `on_reply`
        gets it later)."""
        try:
            match op:
                case ops.Pause(mode=mode):
                    outputs, drained = self.engine.pause(mode, lambda: on_reply({"status": "paused"}))
                    return outputs, {"status": "paused"} if drained else None
                case ops.Command.RESUME:
                    self.engine.resume()
                    return [], {"status": "resumed"}
                case ops.Command.IS_PAUSED:
                    paused = self.engine.paused.mode
                    return [], {"is_paused": paused is not None, "mode": paused and paused.value}
                case ops.AbortRequests(request_ids=ids):
                    return self.abort_requests(ids)
                case ops.Command.START_UPDATE:
                    return [], self.start()
                case ops.Command.ABORT_UPDATE:
                    return [], self.abort_update()
                case ops.SetVersion(version=version):
                    self.engine.set_weight_version(version)
                    return [], self._describe()
                case ops.FinishUpdate(version=version):
                    return self.finish(version)
                case ops.Command.SHUTDOWN_TRANSFER:
                    return [], self.shutdown_transfer()
                case ops.UnloadLoRA(name=name, order=order):
                    if not self.engine.unload_lora(name, order):
                        raise WeightError(WeightErrorKind.NOT_FOUND, f"no LoRA adapter {name!r} is loaded")
                    return [], {"lora_name": name}
                case _:
                    raise TypeError(f"{op} runs beside the steps (run_beside_steps)")
        except WeightError as err:
            return [], err

    def run_beside_steps(self, op: ops.WeightOp) -> Reply:
        """Run `op` beside the steps, on the caller's thread."""
        try:
            match op:
                case ops.UpdateWeights(update_info=info):
                    return self.update(info)
                case ops.Command.GET_INFO:
                    return self.info()
                case ops.InitTransfer(init_info=info):
                    return self.init_transfer(info)
                case ops.LoadLoRA(name=name, path=path, inplace=inplace, order=order):
                    try:
                        adapter = self.engine.load_lora(name, path, inplace, order)
                    except LoRAError as exc:
                        raise WeightError(WeightErrorKind.INCOMPATIBLE, str(exc)) from None
                    return {"lora_name": name, "digest": adapter.identity.digest, "lora_rank": adapter.rank}
                case _:
                    raise TypeError(f"{op} runs between two steps (run)")
        except WeightError as err:
            return err

    # ---- operations between two steps ----------------------------------------------------------
    def abort_requests(self, request_ids: tuple[str, ...]) -> Done:
        running = self.engine.group_ids()
        ids = [i for i in request_ids or running if i in running]
        return self.engine.abort_groups(ids), {"aborted": len(ids)}

    def start(self) -> dict[str, Any]:
        if self.engine.config.tensor_parallel_size > 1:
            raise WeightError(
                WeightErrorKind.INCOMPATIBLE,
                "weight updates are not supported with --tensor-parallel-size above 1",
            )
        with self._lock:
            if self._stage is not None:
                raise WeightError(
                    WeightErrorKind.OUT_OF_ORDER,
                    "a weight update is already started: finish or abort it first",
                )
            self._stage = WeightStage(self.engine.model, self.engine.config.weight_staging_memory_bytes)
            self._staged_digest = None
        return {"started": True}

    def abort_update(self) -> dict[str, Any]:
        with self._lock:
            if self._busy:
                raise WeightError(WeightErrorKind.OUT_OF_ORDER, "an update is still receiving tensors")
            dropped, self._stage = self._stage is not None, None
        return {"dropped": dropped}

    def finish(self, version: str | None) -> Done:
        start = time.perf_counter()
        version = version or f"{INITIAL_VERSION}+{self.updates + 1}"
        with self._lock:
            stage = self._open_stage()
            outputs = self.engine.swap_weights(version, stage.apply)
            self._stage, self._digest = None, self._staged_digest or stage.digest()
        self.updates += 1
        applied = len(stage.staged)
        log.info("weights %s swapped in (%d parameters, %.1f ms)", version, applied, _ms(start))
        return outputs, {**self._describe(), "swap_ms": _ms(start), "parameters": applied}

    def shutdown_transfer(self) -> dict[str, Any]:
        if self._receiver is not None:
            self._receiver.close()
        self._receiver = None
        return {"shut_down": True}

    # ---- operations beside the steps -----------------------------------------------------------
    def init_transfer(self, init_info: dict[str, Any]) -> dict[str, Any]:
        """Join the trainer's group (gloo: blocks until every member has joined)."""
        from kvpilot.daemon.engine.weights.stage import transfer_backend

        config = self.engine.config
        backend = transfer_backend(config.weight_transfer_config)
        if backend in ("gloo", "nccl"):
            from kvpilot.daemon.engine.weights.transports import GroupReceiver

            try:
                self._receiver = GroupReceiver(
                    init_info, config.data_parallel_rank, backend, config.torch_device()
                )
            except WeightError:
                raise
            except Exception as exc:  # noqa: BLE001 - a trainer that never came, a refused connection
                raise WeightError(
                    WeightErrorKind.TRANSFER_FAILED, f"joining the trainer's {backend} group failed: {exc}"
                ) from None
        return {"backend": backend}

    def update(self, info: dict[str, Any]) -> dict[str, Any]:
        start = time.perf_counter()
        with self._lock:
            stage = self._open_stage()
            self._busy = True
        try:
            if "names" in info:
                if self._receiver is None:
                    raise WeightError(
                        WeightErrorKind.OUT_OF_ORDER,
                        "no weight transfer group (call /init_weight_transfer_engine first)",
                    )
                tensors = self._receiver.receive(info)
            else:
                model_path = info.get("model_path")
                if not isinstance(model_path, str) or not model_path:
                    raise WeightError(
                        WeightErrorKind.INCOMPATIBLE,
                        "update_info.model_path must name a checkpoint directory",
                    )
                tensors = checkpoint_tensors(model_path)
            received = stage.put_all(tensors)
            digest = stage.digest()
        except WeightError:
            with self._lock:
                self._stage = None  # an incompatible update leaves nothing half-staged behind
            raise
        finally:
            with self._lock:
                self._busy = False
        with self._lock:
            if self._stage is stage:
                self._staged_digest = digest
        return {"received": received, "staged_digest": digest, "stage_ms": _ms(start)}

    def info(self) -> dict[str, Any]:
        with self._lock:
            if self._digest is None:
                model = self.engine.model
                self._digest = weights_digest({name: w.read for name, w in model.weights().items()})
            return {
                **self._describe(),
                "staged_digest": self._staged_digest,
                "staging": self._stage is not None,
            }

    # ---- helpers -------------------------------------------------------------------------------
    def _open_stage(self) -> WeightStage:
        """The stage an update or a finish works on (hold `_lock`); out of order when there is none or
        an update is still reading into it."""
        if self._stage is None:
            raise WeightError(
                WeightErrorKind.OUT_OF_ORDER, "no weight update is started (call /start_weight_update first)"
            )
        if self._busy:
            raise WeightError(WeightErrorKind.OUT_OF_ORDER, "an update is still receiving tensors")
        return self._stage

    def _describe(self) -> dict[str, Any]:
        return {"weight_version": self.engine.weight_version, "digest": self._digest, "updates": self.updates}


def _ms(start: float) -> float:
    return (time.perf_counter() - start) * 1e3
