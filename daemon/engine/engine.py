"""The engine: one step is schedule -> run the model -> advance the requests.

It is synchronous and single-threaded on purpose. Whoever drives it (the server's engine loop, a
benchmark, a test) calls `step()` in a loop and calls `reset_prefix_cache()` / `stats()` between two
steps, so a reset can never race a step.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from transformers import AutoConfig, AutoTokenizer

from kvpilot.daemon.engine.config import EngineConfig
from kvpilot.daemon.engine.default_model import DEFAULT_MODEL_NAME, ensure_default_model
from kvpilot.daemon.engine.kv_cache_manager import KVCacheManager
from kvpilot.daemon.engine.model_runner import ModelRunner, kv_bytes_per_block
from kvpilot.daemon.engine.models import load_model
from kvpilot.daemon.engine.outputs import CacheStats, RequestOutput, ResetResult
from kvpilot.daemon.engine.request import Request, RequestStatus, SamplingParams
from kvpilot.daemon.engine.scheduler import Scheduler
from kvpilot.kernels import select_ops

if TYPE_CHECKING:
    from kvpilot.daemon.engine.kv_events import KVEventPublisher

log = logging.getLogger(__name__)


class RequestRejected(ValueError):
    """The request can never run here (too long for the context or the KV pool, duplicate id).
    `param` names the offending input, for the server's error reply."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


def resolve_model_dir(model: str | None) -> Path:
    if model is None or model == DEFAULT_MODEL_NAME:
        return ensure_default_model()
    path = Path(model).expanduser()
    if not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"--model {model!r}: not a checkpoint directory (no config.json); models cannot be downloaded "
            f"here, pass a local Hugging Face checkpoint directory or omit --model for {DEFAULT_MODEL_NAME}"
        )
    return path


class LLMEngine:
    def __init__(self, config: EngineConfig | None = None) -> None:
        self.config = config = config or EngineConfig()
        config.validate()
        self.device = config.torch_device()
        if self.device.type == "cpu":
            # Leave a core to the HTTP server and tokenizer: OpenMP threads that compete for every
            # core spin-wait each other into a 5-10x slower step on small machines.
            torch.set_num_threads(config.cpu_threads or max(1, (os.cpu_count() or 2) - 1))
        self.dtype = config.torch_dtype(self.device)
        self.model_dir = resolve_model_dir(config.model)
        hf_config = AutoConfig.from_pretrained(self.model_dir)
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        self.model_name = config.model or DEFAULT_MODEL_NAME
        self.ops = select_ops(self.device, config.kernel_backend)
        model = load_model(self.model_dir, hf_config, self.ops, self.dtype, self.device)

        self.num_blocks = config.num_kv_blocks or self._blocks_from_memory(model)
        pool_tokens = self.num_blocks * config.block_size
        self.max_model_len = min(config.max_model_len or model.args.max_position, model.args.max_position)
        if pool_tokens < self.max_model_len:
            log.warning(
                "KV pool holds %d tokens: max_model_len lowered from %d", pool_tokens, self.max_model_len
            )
            self.max_model_len = pool_tokens
        self.eos_token_ids = _eos_ids(hf_config, self.tokenizer)

        self.kv = KVCacheManager(self.num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(
            self.kv, config.max_num_seqs, config.max_num_batched_tokens, self.max_model_len
        )
        self.runner = ModelRunner(model, self.num_blocks, config.block_size, self.dtype, self.device)
        self.kv_events = self._start_kv_events()  # None when off: nothing is recorded
        self._requests: dict[str, Request] = {}
        self._resets = 0
        self._last_reset_time: float | None = None
        log.info(
            "engine ready: model %s (%s) on %s/%s, ops=%s, %d KV blocks x %d tokens (%.0f MiB), max_model_len %d",
            self.model_name, self.model_dir, self.device, str(self.dtype).removeprefix("torch."), self.ops.name,
            self.num_blocks, config.block_size,
            self.num_blocks * kv_bytes_per_block(model, config.block_size, self.dtype) / 2**20, self.max_model_len,
        )  # fmt: skip

    # ---- requests ----------------------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams | None = None,
        cache_salt: str | None = None,
    ) -> Request:
        params = params or SamplingParams()
        params.validate()
        if request_id in self._requests:
            raise RequestRejected(f"request id {request_id!r} is already running", "request_id")
        if not prompt_token_ids:
            raise RequestRejected("the prompt is empty", "prompt")
        if len(prompt_token_ids) >= self.max_model_len:
            raise RequestRejected(
                f"the prompt has {len(prompt_token_ids)} tokens; this model's context is {self.max_model_len} "
                "tokens and at least one must be left to generate",
                "prompt",
            )
        vocab = self.runner.model.args.vocab_size
        if any(type(t) is not int or not 0 <= t < vocab for t in prompt_token_ids):
            raise RequestRejected(f"prompt token ids must be integers in [0, {vocab})", "prompt")
        if cache_salt is not None and not isinstance(cache_salt, str):
            raise RequestRejected("cache_salt must be a string", "cache_salt")
        req = Request(request_id, list(prompt_token_ids), params, self.eos_token_ids, cache_salt)
        self._requests[request_id] = req
        self.scheduler.add(req)
        return req

    def abort_request(self, request_id: str) -> bool:
        req = self.scheduler.abort(request_id)
        if req is None:
            return False
        self._forget(req)
        return True

    def get_request(self, request_id: str) -> Request | None:
        return self._requests.get(request_id)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    # ---- the step ----------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        self.kv.pool.release_retired()  # the index dropped by the last reset, freed off its clock
        out = self.scheduler.schedule()
        sampled = self.runner.execute(out)
        finished = {r.request_id for r in self.scheduler.update(out, sampled)}
        if self.kv_events is not None:
            self.kv_events.flush()  # one batch per step
        results = []
        for chunk in out.chunks:
            req = chunk.request
            if not chunk.sample or req.request_id not in sampled:
                continue
            done = req.request_id in finished
            results.append(
                RequestOutput(
                    request_id=req.request_id,
                    new_token_ids=[req.output_token_ids[-1]],
                    finished=done,
                    finish_reason=req.finish_reason if done else None,
                    num_prompt_tokens=req.num_prompt_tokens,
                    num_cached_tokens=max(req.num_cached_tokens, 0),
                    num_output_tokens=len(req.output_token_ids),
                )
            )
            if done:
                self._forget(req)
        return results

    # ---- operations (call between steps) -----------------------------------------------------
    def reset_prefix_cache(self, reset_running_requests: bool = False) -> ResetResult:
        """Make every cached block unreachable now. Running requests keep the KV they hold (never
        re-indexed); with `reset_running_requests` they are preempted and recomputed instead."""
        start = time.perf_counter()
        in_flight = len(self.scheduler.running) + len(self.scheduler.waiting)
        preempted = self.scheduler.preempt_all_running() if reset_running_requests else 0
        evicted = self.kv.reset_prefix_cache()
        self._resets += 1
        self._last_reset_time = time.time()
        if self.kv_events is not None:
            self.kv_events.flush()  # AllBlocksCleared is on its way before the reset answers
        return ResetResult(
            success=True,
            epoch=self.kv.epoch,
            evicted_blocks=evicted,
            in_flight_requests=in_flight,
            preempted_requests=preempted,
            duration_ms=(time.perf_counter() - start) * 1e3,
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
        )

    # ---- offline convenience -----------------------------------------------------------------
    def generate(
        self, prompts: list[list[int]], params: SamplingParams | None = None, cache_salt: str | None = None
    ) -> list[list[int]]:
        """Run prompts to completion together (continuous batching); returns their output token ids.
        Requests added by others keep running beside them; their outputs are not collected here."""
        ids = [f"gen-{id(self)}-{time.monotonic_ns()}-{i}" for i in range(len(prompts))]
        outputs: dict[str, list[int]] = {i: [] for i in ids}
        for rid, prompt in zip(ids, prompts):
            self.add_request(rid, prompt, dataclasses.replace(params or SamplingParams()), cache_salt)
        pending = set(ids)
        while pending:
            for o in self.step():
                if o.request_id in outputs:  # others' requests may share the batch
                    outputs[o.request_id].extend(o.new_token_ids)
                    if o.finished:
                        pending.discard(o.request_id)
        return [outputs[i] for i in ids]

    def close(self) -> None:
        if self.kv_events is not None:
            self.kv_events.close()

    def _start_kv_events(self) -> KVEventPublisher | None:
        if not self.config.kv_events_endpoint:
            return None
        from kvpilot.daemon.engine.kv_events import KVEventPublisher

        publisher = KVEventPublisher(
            self.config.kv_events_endpoint, self.config.kv_events_replay_endpoint, self.config.block_size
        )
        self.kv.pool.events = publisher.recorder
        return publisher

    def _forget(self, req: Request) -> None:
        self._requests.pop(req.request_id, None)
        self.runner.sampler.forget(req.request_id)
        assert req.status is RequestStatus.FINISHED

    def _blocks_from_memory(self, model) -> int:  # noqa: ANN001
        per_block = kv_bytes_per_block(model, self.config.block_size, self.dtype)
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            budget = int(free * self.config.gpu_memory_utilization)
        else:
            budget = self.config.kv_cache_memory_bytes
        return max(1, budget // per_block)


def _eos_ids(hf_config, tokenizer) -> tuple[int, ...]:  # noqa: ANN001
    eos = getattr(hf_config, "eos_token_id", None)
    ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return tuple(sorted(ids))
