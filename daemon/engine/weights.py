"""One engine's side of a weight update: pause modes, the stage, the swap, the version.

`WeightControl` belongs to an `LLMEngine` (one per data-parallel rank). Its operations come in two kinds:
- `run(op, args)`: on the engine thread between two steps (pause, resume, start, finish, ...). It returns
  the outputs to deliver (requests ended or restarted by the operation) and the reply, or no reply yet
  when the pause waits for a drain: `on_reply` gets it after the step that drained the batch.
- `run_off_thread(op, args)`: `update` and `info`, which read a checkpoint or hash the weights for up to
  seconds; they run beside the steps and touch only the stage (the live weights are read, never
  written: `_lock` keeps a swap from racing a digest).

The swap (`finish`) copies the stage into the live parameters and starts a cache generation: the prefix
index is reset (epoch + 1, `AllBlocksCleared` with the version) and the version becomes part of every
new block key, so KV computed by other weights can never match, whether or not anyone resets later.
Requests still in the engine follow the pause mode; frozen ones (`keep`, or a finish without a pause)
are recomputed from their prompt with the new weights, so every response comes from one version: a
non-streamed one restarts (its outputs so far are discarded, `RequestOutput.restart`), a stream that has
already sent tokens cannot take them back and ends with finish_reason "abort".
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvpilot.daemon.engine.outputs import RequestOutput
from kvpilot.daemon.engine.request import Request, RequestStatus
from kvpilot.daemon.engine.weight_stage import WeightError, WeightStage, checkpoint_tensors, weights_digest

if TYPE_CHECKING:
    from kvpilot.daemon.engine.engine import LLMEngine

log = logging.getLogger(__name__)

PAUSE_MODES = ("abort", "wait", "keep")
INITIAL_VERSION = "initial"  # the version of weights loaded without --weight-version
MIXED_VERSION = "mixed"  # what /weight_info says when the ranks serve different versions
RESERVED_VERSIONS = frozenset({INITIAL_VERSION, MIXED_VERSION})  # no caller may name weights so
OFF_THREAD_OPS = frozenset({"update", "info", "init_transfer"})


@dataclass(slots=True)
class GroupArgs:
    """What re-adding a request needs when the swap recomputes it."""

    prompt: list[int]
    params: Any
    cache_salt: str | None
    restartable: bool  # nothing of it has reached the client yet (not streamed)
    pinned: str | None  # the weight_version it asked for


class WeightControl:
    def __init__(self, engine: LLMEngine, version: str | None) -> None:
        self.engine = engine
        self.version = version or INITIAL_VERSION
        self.key: str | None = version  # None: the unnamed initial weights add nothing to block keys
        self.mode: str | None = None  # the pause mode, None while serving
        self.drained = False
        self.held: list[str] = []  # groups added while paused, scheduled on resume
        self.groups: dict[str, GroupArgs] = {}
        self.updates = 0
        self._on_drained: Callable[[dict], None] | None = None
        self._digest: str | None = None
        self._stage: WeightStage | None = None
        self._staged_digest: str | None = None
        self._busy = False  # an update is reading into the stage
        self._receiver: Any = None  # the gloo transport's group, once initialized
        self._lock = threading.Lock()

    # ---- what the engine asks ----------------------------------------------------------------
    @property
    def paused(self) -> bool:
        return self.mode is not None

    def may_step(self) -> bool:
        return self.mode is None or (self.mode == "wait" and not self.drained)

    def admit(self, group_id: str, seqs: list[Request], args: GroupArgs) -> bool:
        """A request arrives; False when it is held (paused) instead of scheduled."""
        if args.pinned is not None and args.pinned != self.version:
            from kvpilot.daemon.engine.engine import RequestRejected

            raise RequestRejected(
                f"weight_version {args.pinned!r} is not served here: this server has {self.version!r}",
                "weight_version",
                "weight_version_mismatch",
            )
        for seq in seqs:
            seq.weight_key = self.key
        self.groups[group_id] = args
        if self.mode is not None:
            self.held.append(group_id)
            return False
        return True

    def forget(self, group_id: str) -> None:
        self.groups.pop(group_id, None)

    def after_step(self) -> None:
        if self.mode == "wait" and not self.drained and not self.engine.scheduler.has_unfinished():
            self.drained = True
            if self._on_drained is not None:
                cb, self._on_drained = self._on_drained, None
                cb({"status": "paused"})

    # ---- operations between two steps --------------------------------------------------------
    def run(
        self, op: str, args: dict, on_reply: Callable[[dict], None]
    ) -> tuple[list[RequestOutput], dict | None]:
        """Run `op`; returns the outputs to deliver and the reply (None: `on_reply` gets it later)."""
        try:
            return getattr(self, f"_op_{op}")(args, on_reply)
        except WeightError as err:
            return [], error_reply(err)

    def _op_pause(self, args: dict, on_reply: Callable[[dict], None]) -> tuple[list, dict | None]:
        mode = args.get("mode", "abort")
        if mode not in PAUSE_MODES:
            raise WeightError(400, f"mode must be one of {', '.join(PAUSE_MODES)}, got {mode!r}")
        outputs = self._abort_groups(list(self.engine._groups)) if mode == "abort" else []
        self.mode, self.drained = mode, False
        if mode == "wait" and self.engine.scheduler.has_unfinished():
            self._on_drained = on_reply
            return outputs, None
        self.drained = True
        return outputs, {"status": "paused"}

    def _op_resume(self, args: dict, on_reply: Callable) -> tuple[list, dict]:
        self.mode, self.drained, self._on_drained = None, False, None
        held, self.held = self.held, []
        for gid in held:
            seqs = self.engine._groups.get(gid)
            if seqs and seqs[0].status is RequestStatus.WAITING:
                self.engine.scheduler.add(seqs[0])
        return [], {"status": "resumed"}

    def _op_is_paused(self, args: dict, on_reply: Callable) -> tuple[list, dict]:
        return [], {"is_paused": self.paused, "mode": self.mode}

    def _op_abort(self, args: dict, on_reply: Callable) -> tuple[list, dict]:
        ids = args.get("request_ids") or list(self.engine._groups)
        ids = [i for i in ids if i in self.engine._groups]
        return self._abort_groups(ids), {"aborted": len(ids)}

    def _op_start(self, args: dict, on_reply: Callable) -> tuple[list, dict]:
        if self.engine.config.tensor_parallel_size > 1:
            raise WeightError(400, "weight updates are not supported with --tensor-parallel-size above 1")
        with self._lock:
            if self._stage is not None:
                raise WeightError(409, "a weight update is already started: finish or abort it first")
            self._stage = WeightStage(
                self.engine.runner.model, self.engine.config.weight_staging_memory_bytes
            )
            self._staged_digest = None
        return [], {"started": True}

    def _op_abort_update(self, args: dict, on_reply: Callable) -> tuple[list, dict]:
        with self._lock:
            if self._busy:
                raise WeightError(409, "an update is still receiving tensors")
            dropped, self._stage = self._stage is not None, None
        return [], {"dropped": dropped}

    def _op_set_version(self, args: dict, on_reply: Callable) -> tuple[list, dict]:
        self._set_version(str(args["version"]))
        return [], self._describe()

    def _op_finish(self, args: dict, on_reply: Callable) -> tuple[list, dict]:
        start = time.perf_counter()
        with self._lock:
            stage = self._open_stage()
            outputs, again = self._take_frozen()
            applied = stage.apply()
            digest = self._staged_digest or stage.digest()
            self._stage, self._digest = None, digest
        version = args.get("version") or f"{INITIAL_VERSION}+{self.updates + 1}"
        self._set_version(version)
        self.updates += 1
        for gid, a in again:  # recomputed from the prompt, with the new weights and keys
            self.engine.add_request(gid, a.prompt, a.params, a.cache_salt, restartable=True)
        log.info("weights %s swapped in (%d parameters, %.1f ms)", version, applied, _ms(start))
        return outputs, {**self._describe(), "swap_ms": _ms(start), "parameters": applied}

    # ---- operations beside the steps ---------------------------------------------------------
    def run_off_thread(self, op: str, args: dict) -> dict:
        try:
            if op == "init_transfer":
                return self._init_transfer(args)
            return self._update(args) if op == "update" else self._info()
        except WeightError as err:
            return error_reply(err)

    def _init_transfer(self, args: dict) -> dict:
        """Join the trainer's group (gloo: blocks until every member has joined)."""
        from kvpilot.daemon.engine.weight_stage import transfer_backend

        config = self.engine.config
        backend = transfer_backend(config.weight_transfer_config)
        if backend in ("gloo", "nccl"):
            from kvpilot.daemon.engine.weight_group import GroupReceiver

            try:
                self._receiver = GroupReceiver(
                    args.get("init_info") or {}, config.data_parallel_rank, backend, config.torch_device()
                )
            except WeightError:
                raise
            except Exception as exc:  # noqa: BLE001 - a trainer that never came, a refused connection
                raise WeightError(500, f"joining the trainer's {backend} group failed: {exc}") from None
        return {"backend": backend}

    def _op_shutdown_transfer(self, args: dict, on_reply: Callable) -> tuple[list, dict]:
        if self._receiver is not None:
            self._receiver.close()
        self._receiver = None
        return [], {"shut_down": True}

    def _update(self, args: dict) -> dict:
        start = time.perf_counter()
        with self._lock:
            stage = self._open_stage()
            self._busy = True
        try:
            info = args.get("update_info") or {}
            if "names" in info:
                if self._receiver is None:
                    raise WeightError(
                        409, "no weight transfer group (call /init_weight_transfer_engine first)"
                    )
                tensors = self._receiver.receive(info)
            else:
                model_path = info.get("model_path")
                if not isinstance(model_path, str) or not model_path:
                    raise WeightError(400, "update_info.model_path must name a checkpoint directory")
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

    def _info(self) -> dict:
        with self._lock:
            if self._digest is None:
                model = self.engine.runner.model
                self._digest = weights_digest(model.named_parameters())
            return {
                **self._describe(),
                "staged_digest": self._staged_digest,
                "staging": self._stage is not None,
            }

    # ---- helpers -----------------------------------------------------------------------------
    def _open_stage(self) -> WeightStage:
        """The stage an update or a finish works on (hold `_lock`); 409 when there is none or an
        update is still reading into it."""
        if self._stage is None:
            raise WeightError(409, "no weight update is started (call /start_weight_update first)")
        if self._busy:
            raise WeightError(409, "an update is still receiving tensors")
        return self._stage

    def _describe(self) -> dict:
        return {"weight_version": self.version, "digest": self._digest, "updates": self.updates}

    def _set_version(self, version: str) -> None:
        """A new cache generation: nothing indexed before is reachable, and every key from now on
        carries the version."""
        self.version = self.key = version
        for gid in self.held:
            for seq in self.engine._groups.get(gid, ()):
                seq.weight_key = version
                seq.block_hashes.clear()
        events = self.engine.kv_events
        if events is not None:
            events.recorder.weight_version = version
        self.engine.reset_prefix_cache()

    def _abort_groups(self, ids: list[str]) -> list[RequestOutput]:
        outputs = []
        for gid in ids:
            seqs = self.engine._groups.get(gid, [])
            open_seqs = [s for s in seqs if s.status is not RequestStatus.FINISHED]
            self.engine.abort_request(gid)
            if gid in self.held:
                self.held.remove(gid)
            outputs += [self._ended(s) for s in open_seqs]
        return outputs

    def _ended(self, seq: Request, restart: bool = False) -> RequestOutput:
        return RequestOutput(
            request_id=seq.group_id,
            index=seq.index,
            new_token_ids=[],
            finished=not restart,
            finish_reason=None if restart else "abort",
            num_prompt_tokens=seq.num_prompt_tokens,
            num_cached_tokens=max(seq.num_cached_tokens, 0),
            num_output_tokens=0 if restart else len(seq.output_token_ids),
            weight_version=self.version,
            restart=restart,
        )

    def _take_frozen(self) -> tuple[list[RequestOutput], list[tuple[str, GroupArgs]]]:
        """Take every request out of the engine to start again from its prompt under the new weights;
        a stream that already sent tokens (or a request pinned to the old version) ends instead."""
        outputs: list[RequestOutput] = []
        again: list[tuple[str, GroupArgs]] = []
        for gid, seqs in list(self.engine._groups.items()):
            args = self.groups.get(gid)
            sent = any(s.output_token_ids for s in seqs)
            if args is None or args.pinned is not None or (sent and not args.restartable):
                outputs += self._abort_groups([gid])
                continue
            held = gid in self.held
            self.engine.abort_request(gid)
            if held:
                self.held.remove(gid)
            if sent:
                outputs += [self._ended(s, restart=True) for s in seqs]
            again.append((gid, args))
        return outputs, again


def error_reply(err: WeightError) -> dict:
    return {"error": str(err), "status": err.status, "tensor": err.tensor}


def _ms(start: float) -> float:
    return (time.perf_counter() - start) * 1e3
