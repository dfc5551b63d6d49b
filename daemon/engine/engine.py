"""The engine: one step is schedule -> run the model -> sample -> advance the requests.

It is synchronous and single-threaded on purpose. Whoever drives it (the server's engine loop, a
benchmark, a test) calls `step()` in a loop and calls `reset_prefix_cache()` / `stats()` between two
steps, so a reset can never race a step. Loading a checkpoint is `loader.py`'s job.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from kvpilot.daemon.engine.client import EngineRequest
from kvpilot.daemon.engine.config import EngineConfig
from kvpilot.daemon.engine.cpu_budget import engine_threads
from kvpilot.daemon.engine.kv.cache_manager import KVCacheManager, KVTransfers
from kvpilot.daemon.engine.kv.cache_scope import scope_filter
from kvpilot.daemon.engine.kv.offload import DiskTier, HostTier, KVOffload, checkpoint_files
from kvpilot.daemon.engine.loader import load
from kvpilot.daemon.engine.model_runner import ModelRunner, kv_block_shape, kv_bytes_per_block
from kvpilot.daemon.engine.outputs import CacheStats, RequestOutput, ResetResult, TokenLogprob
from kvpilot.daemon.engine.pause import PauseState, stopped_output
from kvpilot.daemon.engine.request import Request, RequestStatus, SamplingParams
from kvpilot.daemon.engine.sampler import Sampler, token_logprobs
from kvpilot.daemon.engine.scheduler import Scheduler, SchedulerOutput
from kvpilot.daemon.engine.weights.lora import (
    LoRAAdapter,
    LoRAError,
    LoRARegistry,
    check_name,
    load_adapter,
    parse_lora_modules,
)
from kvpilot.daemon.engine.weights.ops import INITIAL_VERSION, PauseMode
from kvpilot.kernels import select_ops
from kvpilot.kv.block_keys import key_scheme
from kvpilot.kv.reset_scope import ResetScope

if TYPE_CHECKING:
    from kvpilot.daemon.engine.kv.publisher import KVEventPublisher

log = logging.getLogger(__name__)


class RequestRejected(ValueError):
    """The request can never run here (too long for the context or the KV pool, duplicate id).
    `param` names the offending input and `code` the reason, for the server's error reply."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.param = param
        self.code = code


class QueueFull(RuntimeError):
    """`max_queued_requests` requests are already waiting: try again later (the server's 503)."""


class LLMEngine:
    def __init__(self, config: EngineConfig | None = None) -> None:
        self.config = config = config or EngineConfig()
        config.validate()
        self.device = config.torch_device()
        if self.device.type == "cpu":
            # OpenMP threads that compete for more cores than the container may use spin-wait each
            # other into a 5-10x slower step: follow the affinity mask and the cgroup CPU quota.
            torch.set_num_threads(engine_threads(config.cpu_threads))
        self.dtype = config.torch_dtype(self.device)
        self.ops = select_ops(self.device, config.kernel_backend)
        loaded = load(config.model, self.ops, self.dtype, self.device)
        self.model_name, self.model_dir, self.tokenizer = loaded.name, loaded.model_dir, loaded.tokenizer
        self.eos_token_ids = loaded.eos_token_ids
        model = loaded.model
        tp = None
        if config.tensor_parallel_size > 1:
            from kvpilot.daemon.engine.parallel.tp import TensorParallel

            tp = TensorParallel(config, model, self.device)  # shards `model`: rank 0 of the group

        self.num_blocks = config.num_kv_blocks or self._blocks_from_memory(model)
        if tp is not None:
            tp.share_num_blocks(self.num_blocks)
        pool_tokens = self.num_blocks * config.block_size
        self.max_model_len = min(config.max_model_len or model.args.max_position, model.args.max_position)
        if pool_tokens < self.max_model_len:
            log.warning(
                "KV pool holds %d tokens: max_model_len lowered from %d", pool_tokens, self.max_model_len
            )
            self.max_model_len = pool_tokens

        offload = self._start_offload(model) if config.offloads_kv else None
        self.kv = KVCacheManager(self.num_blocks, config.block_size, config.enable_prefix_caching, offload)
        self.scheduler = Scheduler(
            self.kv, config.max_num_seqs, config.max_num_batched_tokens, self.max_model_len
        )
        self.loras = self._load_loras(model)
        self.scheduler.max_loras = config.max_loras if config.enable_lora else None
        self.runner = ModelRunner(model, self.num_blocks, config.block_size, self.dtype, self.device)
        if tp is not None:
            self.runner.on_step = tp.send_step
        self.sampler = Sampler()
        self._groups: dict[str, list[Request]] = {}
        self._added: dict[str, EngineRequest] = {}  # each group as added: what a weight swap restarts
        self.keys = key_scheme(config.prefix_caching_hash_algo)
        self.kv_events = self._start_kv_events()  # None when off: nothing is recorded
        if offload is not None and self.kv_events is not None:
            offload.on_stored = self.kv_events.recorder.block_offloaded
            offload.on_removed = self.kv_events.recorder.block_removed
        self._resets = 0
        self._last_reset_time: float | None = None
        self.weight_version = config.weight_version or INITIAL_VERSION
        self._weight_key = config.weight_version  # None: unnamed initial weights add nothing to block keys
        self.paused = PauseState()
        log.info(
            "engine ready: model %s (%s) on %s/%s x %d shard(s), ops=%s, %d torch threads, %d KV blocks x %d tokens (%.0f MiB), max_model_len %d",
            self.model_name,
            self.model_dir,
            self.device,
            str(self.dtype).removeprefix("torch."),
            config.tensor_parallel_size,
            self.ops.name,
            torch.get_num_threads(),
            self.num_blocks,
            config.block_size,
            self.num_blocks * kv_bytes_per_block(model, config.block_size, self.dtype) / 2**20,
            self.max_model_len,
        )

    # ---- requests ----------------------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams | None = None,
        cache_salt: str | None = None,
        restartable: bool = False,
        weight_version: str | None = None,
        lora_name: str | None = None,
        *,
        adapter: LoRAAdapter | None = None,
    ) -> list[Request]:
        """Queue one request: `params.n` sequences sharing the prompt. Their outputs carry
        `request_id` and the sequence's `index`. `restartable`: nothing of it reaches the client before
        it ends, so a weight swap may start it again; `weight_version` pins the weights it must run on
        (`weights/control.py`); `lora_name` names the adapter it runs under (`adapter`: that adapter itself, as
        a restart keeps the one it began with, unloaded since or not). While paused it is held, not
        scheduled, until `resume`."""
        params = params or SamplingParams()
        params.validate()
        if request_id in self._groups:
            raise RequestRejected(f"request id {request_id!r} is already running", "request_id")
        self._check_fits(prompt_token_ids, params)
        if cache_salt is not None and not isinstance(cache_salt, str):
            raise RequestRejected("cache_salt must be a string", "cache_salt")
        lora = adapter
        if lora is None and lora_name is not None:
            try:
                lora = self.loras.get(lora_name)  # its weights read again if they were let go
            except LoRAError as exc:
                raise RequestRejected(str(exc), "model", "invalid_lora_adapter") from None
            if lora is None:
                raise RequestRejected(f"no LoRA adapter {lora_name!r} is loaded", "model", "model_not_found")
        limit = self.config.max_queued_requests
        if limit is not None and len(self.scheduler.waiting) >= limit:
            raise QueueFull(f"{limit} requests are already waiting")
        if weight_version is not None and weight_version != self.weight_version:
            raise RequestRejected(
                f"weight_version {weight_version!r} is not served here: this server has {self.weight_version!r}",
                "weight_version",
                "weight_version_mismatch",
            )
        seqs = [
            Request(
                request_id if params.n == 1 else f"{request_id}#{i}",
                list(prompt_token_ids),
                dataclasses.replace(params, seed=params.seed_of(i)),
                self.eos_token_ids,
                cache_salt,
                group_id=request_id,
                index=i,
                weight_key=self._weight_key,
                keys=self.keys,
                lora=lora,
            )
            for i in range(params.n)
        ]
        for follower in seqs[1:]:
            follower.prompt_logprobs = None  # the first sequence scores the prompt for all
        seqs[0].forks = seqs[1:]
        self._groups[request_id] = seqs
        self._added[request_id] = EngineRequest(
            request_id,
            list(prompt_token_ids),
            params,
            cache_salt,
            None,
            restartable,
            weight_version,
            lora_name,
        )
        if not self.paused.hold(request_id):
            self.scheduler.add(seqs[0])
        return seqs

    def submit(self, req: EngineRequest) -> list[Request]:
        """`add_request` for a request as the server hands it over (`client.EngineRequest`)."""
        return self.add_request(
            req.request_id,
            req.prompt_token_ids,
            req.params,
            req.cache_salt,
            req.restartable,
            req.weight_version,
            req.lora_name,
        )

    def abort_request(self, request_id: str) -> bool:
        """Abort every sequence of the request; False when it is not running."""
        seqs = self._groups.pop(request_id, None)
        self._added.pop(request_id, None)
        self.paused.release(request_id)
        if seqs is None:
            return False
        for seq in seqs:
            if seq.status is not RequestStatus.FINISHED and self.scheduler.abort(seq.request_id) is None:
                seq.finish_reason, seq.status = "abort", RequestStatus.FINISHED  # not forked yet
            self.sampler.forget(seq.request_id)
        seqs[0].forks = []
        return True

    def has_unfinished_requests(self) -> bool:
        """Work for the next step (none while paused: held and frozen requests wait)."""
        return self.paused.may_step() and self.scheduler.has_unfinished()

    # ---- the step ----------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        self.kv.pool.release_retired()  # the index dropped by the last reset, freed off its clock
        if self.kv.offload is not None:
            self.kv.offload.poll()
        out = self.scheduler.schedule()
        if out.kv_transfers:
            self._transfer_kv(out.kv_transfers)
        if not out.chunks:
            if self.kv.offload is not None:
                self.kv.offload.wait_for_reads(timeout=0.01)
            self._flush_kv_events()
            self.paused.after_step(self.scheduler.has_unfinished())
            return []
        logits = self.runner.execute(out)
        sampled = self._sample(out, logits)
        advanced = self.scheduler.update(out, sampled)
        self._flush_kv_events()
        outputs = [self._output(seq) for seq in advanced]
        self.paused.after_step(self.scheduler.has_unfinished())
        return outputs

    def _transfer_kv(self, t: KVTransfers) -> None:
        """Evicted blocks into the offload tiers, then blocks found there back into the pool: before the
        forward pass, which may overwrite the one and reads the other."""
        if t.saves:
            self.kv.store_offloaded(t.saves, self.runner.read_blocks([b for b, _, _ in t.saves]))
        if t.loads:
            self.runner.write_blocks([b for b, _ in t.loads], [data for _, data in t.loads])

    def _flush_kv_events(self) -> None:
        if self.kv_events is not None:
            self.kv_events.flush()  # one batch per step

    def _sample(
        self, out: SchedulerOutput, logits: torch.Tensor
    ) -> dict[str, tuple[int, TokenLogprob | None]]:
        """Score prompt positions (prompt logprobs) and sample every chunk that reaches its end;
        sequences forking off a chunk's request sample their first token from its logits row."""
        rows: list[int] = []
        seqs: list[Request] = []
        first = 0
        for c in out.chunks:
            end = c.start + c.num_tokens
            req = c.request
            if req.prompt_logprobs is not None:
                self._score_prompt(req, c.logits_from, min(end, req.num_prompt_tokens - 1), logits[first:])
            first += end - c.logits_from
            if c.sample:
                for seq in (req, *(req.forks if not req.output_token_ids else ())):
                    rows.append(first - 1)
                    seqs.append(seq)
        if not rows:
            return {}
        # A decode step samples every row in order: no need to gather a copy of the logits.
        picked = logits if rows == list(range(len(logits))) else logits[rows]
        tokens, logprobs = self.sampler.sample(picked, seqs)
        return {s.request_id: (t, lp) for s, t, lp in zip(seqs, tokens, logprobs)}

    def _score_prompt(self, req: Request, start: int, stop: int, logits: torch.Tensor) -> None:
        """Logprobs of prompt tokens start+1 .. stop from the logits of positions start .. stop-1."""
        if stop <= start:
            return
        targets = req.all_token_ids[start + 1 : stop + 1]
        top, scored = req.params.prompt_logprobs, req.prompt_logprobs
        assert top is not None and scored is not None  # only for requests that asked for prompt logprobs
        found = token_logprobs(logits[: stop - start], targets, [top] * len(targets))
        scored[start + 1 : stop + 1] = found

    def _output(self, seq: Request) -> RequestOutput:
        done = seq.status is RequestStatus.FINISHED
        prompt_logprobs, new_logprobs = seq.prompt_logprobs, seq.new_logprobs
        seq.prompt_logprobs = None  # delivered once; a recompute after preemption may hit the cache
        seq.new_logprobs = []
        out = RequestOutput(
            request_id=seq.group_id,
            index=seq.index,
            new_token_ids=seq.output_token_ids[-1:] if seq.params.max_tokens else [],
            finished=done,
            finish_reason=seq.finish_reason if done else None,
            num_prompt_tokens=seq.num_prompt_tokens,
            num_cached_tokens=max(seq.num_cached_tokens, 0),
            num_output_tokens=len(seq.output_token_ids),
            logprobs=new_logprobs if seq.params.logprobs is not None else None,
            prompt_logprobs=prompt_logprobs,
            cumulative_logprob=seq.cumulative_logprob,
            weight_version=self.weight_version,
        )
        if done:
            self.sampler.forget(seq.request_id)
            group = self._groups.get(seq.group_id, ())
            if all(s.status is RequestStatus.FINISHED for s in group):
                self._groups.pop(seq.group_id, None)
                self._added.pop(seq.group_id, None)
        return out

    def _check_fits(self, prompt: list[int], params: SamplingParams) -> None:
        """The one context-length check: the prompt, and the prompt plus an explicit max_tokens."""
        if not prompt:
            raise RequestRejected("the prompt is empty", "prompt")
        n, limit = len(prompt), self.max_model_len
        if n >= limit + (params.max_tokens == 0):
            raise RequestRejected(
                f"This model's maximum context length is {limit} tokens; the prompt has {n} tokens "
                "(at least one token must be left for the completion)",
                "prompt",
                "context_length_exceeded",
            )
        if n + params.max_tokens > limit:
            raise RequestRejected(
                f"This model's maximum context length is {limit} tokens; you requested "
                f"{n + params.max_tokens} tokens ({n} in the prompt, {params.max_tokens} for the completion)",
                "max_tokens",
                "context_length_exceeded",
            )
        vocab = self.runner.model.args.vocab_size
        if any(type(t) is not int or not 0 <= t < vocab for t in prompt):
            raise RequestRejected(f"prompt token ids must be integers in [0, {vocab})", "prompt")

    # ---- operations (call between steps) -----------------------------------------------------
    def reset_prefix_cache(
        self, reset_running_requests: bool = False, scope: ResetScope | None = None
    ) -> ResetResult:
        """Make every cached block unreachable now, or with `scope` those of one adapter, salt or weight
        version. Running requests keep the KV they hold (never re-indexed); with `reset_running_requests`
        they (those of the scope) are preempted and recomputed instead."""
        start = time.perf_counter()
        in_flight = len(self.scheduler.running) + len(self.scheduler.waiting)
        if scope is None:
            preempted = self.scheduler.preempt_running() if reset_running_requests else 0
            evicted = self.kv.reset_prefix_cache()  # every tier
        else:
            match = scope_filter(scope, INITIAL_VERSION)
            preempted = (
                self.scheduler.preempt_running(lambda r: match(r.cache_scope))
                if reset_running_requests
                else 0
            )
            evicted = self.kv.reset_prefix_cache(match)
        self._resets += 1
        self._last_reset_time = time.time()
        if self.kv_events is not None:
            self.kv_events.flush()  # AllBlocksCleared is on its way before the reset answers
        return ResetResult(
            success=True,
            epoch=self.kv.epoch,
            evicted_blocks=evicted["pool"],
            in_flight_requests=in_flight,
            preempted_requests=preempted,
            duration_ms=(time.perf_counter() - start) * 1e3,
            evicted_by_tier=evicted,
            scope=None if scope is None else scope.to_dict(),
        )

    def stats(self) -> CacheStats:
        pool = self.kv.pool
        return CacheStats(
            epoch=pool.epoch,
            block_size=self.config.block_size,
            blocks_total=pool.num_blocks,
            blocks_free=pool.num_free_blocks - pool.num_cached_blocks,
            blocks_cached=pool.num_cached_blocks,
            blocks_used=pool.num_used_blocks,
            query_tokens=self.kv.query_tokens,
            hit_tokens=self.kv.hit_tokens,
            resets=self._resets,
            last_reset_time=self._last_reset_time,
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            num_preemptions=self.scheduler.num_preemptions,
            offload=self.kv.offload.stats() if self.kv.offload is not None else (),
            max_loras=self.config.max_loras if self.config.enable_lora else 0,
            lora_running=_adapter_names(self.scheduler.running),
            lora_waiting=_adapter_names(self.scheduler.waiting),
        )

    # ---- pause and weight generations (weights/control.py drives them, between two steps) -------------
    def pause(self, mode: PauseMode, on_drained: Callable[[], None]) -> tuple[list[RequestOutput], bool]:
        """Stop stepping: ABORT ends every request, KEEP freezes them, WAIT steps until the batch has
        drained (`PauseState.start`). Returns the ended requests' outputs and whether it is drained."""
        outputs = self.abort_groups(self.group_ids()) if mode is PauseMode.ABORT else []
        return outputs, self.paused.start(mode, self.scheduler.has_unfinished(), on_drained)

    def resume(self) -> None:
        """Step again; the requests held while paused are scheduled."""
        for gid in self.paused.end():
            seqs = self._groups.get(gid)
            if seqs and seqs[0].status is RequestStatus.WAITING:
                self.scheduler.add(seqs[0])

    def group_ids(self) -> list[str]:
        return list(self._groups)  # the requests in the engine (running, waiting or held)

    def abort_groups(self, ids: list[str]) -> list[RequestOutput]:
        """Abort these requests; each open sequence's last output (finish_reason "abort")."""
        outputs = []
        for gid in ids:
            open_seqs = [s for s in self._groups.get(gid, ()) if s.status is not RequestStatus.FINISHED]
            self.abort_request(gid)
            outputs += [stopped_output(s, self.weight_version) for s in open_seqs]
        return outputs

    def swap_weights(self, version: str, apply: Callable[[], object]) -> list[RequestOutput]:
        """New weights: every request is taken out, `apply` changes the weights, a new cache generation
        starts (`set_weight_version`), and each request starts again from its prompt; a stream that sent
        tokens, or one pinned to the old version, ends instead. The outputs of those ended or restarted."""
        outputs: list[RequestOutput] = []
        again: list[tuple[EngineRequest, LoRAAdapter | None]] = []
        for gid, seqs in list(self._groups.items()):
            added, sent = self._added.get(gid), any(s.output_token_ids for s in seqs)
            ended = self.abort_groups([gid])
            if added is None or added.weight_version is not None or (sent and not added.restartable):
                outputs += ended
                continue
            if sent:
                outputs += [stopped_output(s, self.weight_version, restart=True) for s in seqs]
            again.append((added, seqs[0].lora))
        apply()
        self.set_weight_version(version)
        for a, lora in again:  # with the new weights and keys, each under the adapter it began with
            self.add_request(
                a.request_id, a.prompt_token_ids, a.params, a.cache_salt, restartable=True, adapter=lora
            )
        return outputs

    # ---- LoRA adapters -----------------------------------------------------------------------------
    def load_lora(self, name: str, path: str, inplace: bool) -> LoRAAdapter:
        """Read and serve an adapter (LoRAError if it cannot be). May run beside the steps: the registry
        takes it in one assignment, and requests already running keep the adapter they started with,
        whose identity keys their blocks, so nothing the old weights computed is served after a reload."""
        if not self.config.enable_lora:
            raise LoRAError("LoRA adapters are off: start the daemon with --enable-lora")
        check_name(name)
        if name in self.loras.served and not inplace:
            raise LoRAError(f"adapter {name!r} is already loaded (load_inplace replaces it)")
        adapter = self.loras.read(name, path)
        self.loras.add(adapter)
        return adapter

    def unload_lora(self, name: str) -> bool:
        """Stop serving an adapter (False: none of that name). Its running requests finish with it."""
        return self.loras.remove(name)

    def set_weight_version(self, version: str) -> None:
        """A new cache generation: nothing indexed before is reachable, every key from now on has it."""
        self.weight_version = self._weight_key = version
        for gid in self.paused.held:
            for seq in self._groups.get(gid, ()):
                seq.weight_key = version
                seq.block_hashes.clear()
        if self.kv_events is not None:
            self.kv_events.recorder.weight_version = version
        self.reset_prefix_cache()

    # ---- offline convenience -----------------------------------------------------------------
    def generate(
        self,
        prompts: list[list[int]],
        params: SamplingParams | None = None,
        cache_salt: str | None = None,
        lora_names: list[str | None] | None = None,
    ) -> list[list[int]]:
        """Run prompts to completion together (continuous batching); returns their output token ids
        (the first sequence's when n > 1). `lora_names`: each prompt's adapter (None: the base model).
        Requests added by others keep running beside them; their outputs are not collected here."""
        ids = [f"gen-{id(self)}-{time.monotonic_ns()}-{i}" for i in range(len(prompts))]
        outputs: dict[str, list[int]] = {i: [] for i in ids}
        loras = lora_names or [None] * len(prompts)
        for rid, prompt, lora in zip(ids, prompts, loras, strict=True):
            params_i = dataclasses.replace(params or SamplingParams())
            self.add_request(rid, prompt, params_i, cache_salt, lora_name=lora)
        pending = set(ids)
        while pending:
            for o in self.step():
                if o.request_id in outputs and o.index == 0:  # others' requests may share the batch
                    outputs[o.request_id].extend(o.new_token_ids)
            pending = {i for i in pending if i in self._groups}
        return [outputs[i] for i in ids]

    def close(self) -> None:
        if self.kv_events is not None:
            self.kv_events.close()
        if self.kv.offload is not None:
            self.kv.offload.close()

    def _load_loras(self, model) -> LoRARegistry:  # noqa: ANN001
        """The adapters --lora-modules names, each checked against the base model (a bad one stops the
        start with its reason)."""
        c = self.config

        def read(name: str, path: str | Path) -> LoRAAdapter:
            return load_adapter(name, path, model, c.max_lora_rank, self.dtype, self.device)

        loras = LoRARegistry(read, c.max_cpu_loras)
        if c.enable_lora:
            for name, path in parse_lora_modules(c.lora_modules).items():
                loras.add(read(name, path))
        return loras

    def _start_offload(self, model) -> KVOffload:  # noqa: ANN001
        """The tiers below the pool (kv/offload.py); a data-parallel rank gets its share of each and a
        directory of its own."""
        c = self.config
        shape = kv_block_shape(model, c.block_size)
        block_bytes = kv_bytes_per_block(model, c.block_size, self.dtype)
        share = c.data_parallel_size
        host = disk = None
        if c.kv_offloading_size is not None:
            host = HostTier(int(c.kv_offloading_size * 2**30) // share, block_bytes)
        if c.kv_offloading_dir is not None:
            root = Path(c.kv_offloading_dir)
            if share > 1:
                root /= f"rank-{c.data_parallel_rank}"
            identity = {"model": str(self.model_dir), "files": checkpoint_files(self.model_dir)}
            disk = DiskTier(root, int(c.kv_offloading_dir_size * 2**30) // share, shape, self.dtype, identity)
        log.info(
            "KV offloading: host %s, disk %s, %.0f KiB a block",
            f"{host.capacity_bytes / 2**30:.2f} GiB" if host else "off",
            f"{disk.root} ({disk.capacity_bytes / 2**30:.2f} GiB, {len(disk)} blocks kept)"
            if disk
            else "off",
            block_bytes / 1024,
        )
        return KVOffload(host, disk)

    def _start_kv_events(self) -> KVEventPublisher | None:
        if not self.config.kv_events_endpoint:
            return None
        from kvpilot.daemon.engine.kv.publisher import KVEventPublisher

        publisher = KVEventPublisher(
            self.config.kv_events_endpoint,
            self.config.kv_events_replay_endpoint,
            self.config.block_size,
            rank=self.config.data_parallel_rank,
            token_ids=self.config.kv_events_token_ids,
            keys=self.keys,
            curve_dir=self.config.kv_events_curve_dir,
            # every block the rank can hold, offload tiers included: a consumer caps its index of this
            # rank at it (router/kv/index.py), and a tier holds blocks the pool no longer does
            blocks_total=self.num_blocks + (self.kv.offload.capacity_blocks if self.kv.offload else 0),
        )
        self.kv.pool.events = publisher.recorder
        return publisher

    def _blocks_from_memory(self, model) -> int:  # noqa: ANN001
        per_block = kv_bytes_per_block(model, self.config.block_size, self.dtype)
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            budget = int(free * self.config.gpu_memory_utilization)
        else:
            budget = self.config.kv_cache_memory_bytes
        return max(1, budget // per_block)


def _adapter_names(requests: Iterable[Request]) -> tuple[str, ...]:
    return tuple(sorted({r.lora.name for r in requests if r.lora is not None}))
