"""The engine: one step is schedule -> run the model -> sample -> advance the requests.

It is synchronous and single-threaded on purpose. Whoever drives it (the server's engine loop, a
benchmark, a test) calls `step()` in a loop and calls `reset_prefix_cache()` / `stats()` between two
steps, so a reset can never race a step. What it steps (model, pool, scheduler, runner) is built by
`build.py`; resets and stats are `kv/control.py`'s, admission checks `admission.py`'s.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable

from kvpilot.daemon.engine.admission import QueueFull, RequestRejected, adapter_for, check_fits, check_version
from kvpilot.daemon.engine.build import build_engine
from kvpilot.daemon.engine.client import EngineRequest
from kvpilot.daemon.engine.config import EngineConfig
from kvpilot.daemon.engine.kv.cache_manager import KVTransfers
from kvpilot.daemon.engine.kv.control import CacheControl
from kvpilot.daemon.engine.models.llama import LlamaForCausalLM
from kvpilot.daemon.engine.outputs import CacheStats, RequestOutput, ResetResult
from kvpilot.daemon.engine.request import Request, RequestGroups, RequestStatus, SamplingParams, new_group
from kvpilot.daemon.engine.sampler import Sampler
from kvpilot.daemon.engine.weights.lora import LoRAAdapter, LoRAError
from kvpilot.daemon.engine.weights.ops import INITIAL_VERSION, PauseMode, next_lora_order
from kvpilot.daemon.engine.weights.pause import PauseState, stopped_output
from kvpilot.daemon.kv_transfer.held import HeldSummary
from kvpilot.daemon.kv_transfer.remote import PullPlan
from kvpilot.kv.block_keys import BlockHash
from kvpilot.kv.reset_scope import ResetScope

log = logging.getLogger(__name__)


class LLMEngine:
    def __init__(self, config: EngineConfig | None = None) -> None:
        parts = build_engine(config or EngineConfig())
        self.config = parts.config
        self.device, self.dtype, self.ops = parts.device, parts.dtype, parts.ops
        self.model_name, self.model_dir, self.tokenizer = parts.model_name, parts.model_dir, parts.tokenizer
        self.eos_token_ids = parts.eos_token_ids
        self.num_blocks, self.max_model_len = parts.num_blocks, parts.max_model_len
        self.kv, self.scheduler, self.runner = parts.kv, parts.scheduler, parts.runner
        self.loras, self.keys, self.kv_events = parts.loras, parts.keys, parts.kv_events
        self.connector = parts.connector
        self.sampler = Sampler()
        max_loras = self.config.max_loras if self.config.enable_lora else 0
        held = self.connector.held if self.connector is not None else None
        self.cache = CacheControl(
            self.kv, self.scheduler, self.kv_events, self.config.block_size, max_loras, held
        )
        self.groups = RequestGroups()
        self.weight_version = self.config.weight_version or INITIAL_VERSION
        self._weight_key = self.config.weight_version  # None: unnamed initial weights add nothing to keys
        self.paused = PauseState()

    @property
    def model(self) -> LlamaForCausalLM:
        """The model the runner runs: what a weight update stages against and swaps into."""
        return self.runner.model

    @property
    def vocab_size(self) -> int:
        return self.runner.model.args.vocab_size

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
        pin_prefix: bool = False,
    ) -> list[Request]:
        """Queue one request: `params.n` sequences sharing the prompt. Their outputs carry
        `request_id` and the sequence's `index`. `restartable`: nothing of it reaches the client before
        it ends, so a weight swap may start it again; `weight_version` pins the weights it must run on
        (`weights/control.py`); `lora_name` names the adapter it runs under (`adapter`: that adapter itself, as
        a restart keeps the one it began with, unloaded since or not); `pin_prefix` pins its prompt's full
        blocks at its first token (its outputs' `pin` say what it got from then on). While paused it is held, not
        scheduled, until `resume` (`submit` queues it)."""
        params = params or SamplingParams()
        prompt = list(prompt_token_ids)
        req = EngineRequest(
            request_id, prompt, params, cache_salt, None, restartable, weight_version, lora_name, pin_prefix
        )
        return self.submit(req, adapter)

    def submit(self, req: EngineRequest, adapter: LoRAAdapter | None = None) -> list[Request]:
        """Queue a request as the server hands it over (`client.EngineRequest`); `adapter` as in
        `add_request`. Checked before anything is queued: a refusal raises `RequestRejected`/`QueueFull`."""
        req.params.validate()
        if req.request_id in self.groups:
            raise RequestRejected(f"request id {req.request_id!r} is already running", "request_id")
        check_fits(req.prompt_token_ids, req.params, self.max_model_len, self.vocab_size)
        if req.cache_salt is not None and not isinstance(req.cache_salt, str):
            raise RequestRejected("cache_salt must be a string", "cache_salt")
        if (lora := adapter) is None and req.lora_name is not None:
            lora = adapter_for(self.loras, req.lora_name)
        limit = self.config.max_queued_requests
        if limit is not None and len(self.scheduler.waiting) >= limit:
            raise QueueFull(f"{limit} requests are already waiting")
        check_version(req.weight_version, self.weight_version)
        seqs = new_group(req, self.eos_token_ids, weight_key=self._weight_key, keys=self.keys, lora=lora)
        # What a restart needs of it, without pulled KV: that is landed once, and not held for the request's life
        self.groups.add(dataclasses.replace(req, remote_kv=None) if req.remote_kv is not None else req, seqs)
        if not self.paused.hold(req.request_id):
            self.scheduler.add(seqs[0])
        return seqs

    def abort_request(self, request_id: str) -> bool:
        """Abort every sequence of the request; False when it is not running."""
        seqs = self.groups.pop(request_id)
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
        sampled = self.sampler.sample_step(out, logits)
        advanced = self.scheduler.update(out, sampled)
        for req in self.scheduler.take_handoffs():
            self._hold(req)
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

    def _hold(self, req: Request) -> None:
        """A prefill for a remote decode ended: its prompt's full blocks (all but a last one the decode
        side computes anyway, for its last token) are copied off the pool and held for one pull, then the
        request lets its blocks go. Nothing is held when a reset came while it ran: its KV began before."""
        held = self.connector.held if self.connector is not None else None
        n = (req.num_prompt_tokens - 1) // self.config.block_size
        if held is not None and req.kv_hold is not None and n > 0 and self.kv.began_in_live_index(req):
            req.update_block_hashes(self.config.block_size)
            data, ready = self.runner.gather_blocks(self.kv.block_ids(req)[:n])
            req.held = held.hold(req.kv_hold, tuple(req.block_hashes[:n]), data, ready, req.cache_scope)
        elif held is not None:
            req.held = HeldSummary((), held.epoch)
        self.kv.free(req)

    def plan_pull(self, request: EngineRequest, remote_keys: list[BlockHash]) -> PullPlan:
        """Which of a prefill pod's held blocks the request should pull (`KVCacheManager.plan_pull`), and
        the reset generation the plan was made in."""
        lora = adapter_for(self.loras, request.lora_name) if request.lora_name is not None else None
        (seq, *_) = new_group(
            request, self.eos_token_ids, weight_key=self._weight_key, keys=self.keys, lora=lora
        )
        first, count, matched = self.kv.plan_pull(seq, remote_keys)
        return PullPlan(first, count, self.kv.generation, matched)

    def _flush_kv_events(self) -> None:
        if self.kv_events is not None:
            self.kv_events.flush()  # one batch per step

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
            pin=seq.pinned,
            held=seq.held if done else None,
        )
        if done:
            self.sampler.forget(seq.request_id)
            self.groups.finished(seq)
        return out

    # ---- operations (call between steps) -----------------------------------------------------
    def reset_prefix_cache(
        self, reset_running_requests: bool = False, scope: ResetScope | None = None
    ) -> ResetResult:
        """Make every cached block unreachable now, or those of one scope (`CacheControl.reset`)."""
        return self.cache.reset(reset_running_requests, scope)

    def unpin_prefixes(self, scope: ResetScope | None = None) -> int:
        """Let go of every pinned block, or those of one scope (`CacheControl.unpin`); how many."""
        return self.cache.unpin(scope)

    def stats(self) -> CacheStats:
        return dataclasses.replace(self.cache.stats(), lora_reloads=self.loras.reloads)

    # ---- pause and weight generations (weights/control.py drives them, between two steps) -------------
    def pause(self, mode: PauseMode, on_drained: Callable[[], None]) -> tuple[list[RequestOutput], bool]:
        """Stop stepping: ABORT ends every request, KEEP freezes them, WAIT steps until the batch has
        drained (`PauseState.start`). Returns the ended requests' outputs and whether it is drained."""
        outputs = self.abort_groups(self.group_ids()) if mode is PauseMode.ABORT else []
        return outputs, self.paused.start(mode, self.scheduler.has_unfinished(), on_drained)

    def resume(self) -> None:
        """Step again; the requests held while paused are scheduled."""
        for gid in self.paused.end():
            seqs = self.groups.get(gid)
            if seqs and seqs[0].status is RequestStatus.WAITING:
                self.scheduler.add(seqs[0])

    def group_ids(self) -> list[str]:
        return self.groups.ids()  # the requests in the engine (running, waiting or held)

    def abort_groups(self, ids: list[str]) -> list[RequestOutput]:
        """Abort these requests; each open sequence's last output (finish_reason "abort")."""
        outputs = []
        for gid in ids:
            open_seqs = [s for s in self.groups.get(gid) if s.status is not RequestStatus.FINISHED]
            self.abort_request(gid)
            outputs += [stopped_output(s, self.weight_version) for s in open_seqs]
        return outputs

    def swap_weights(self, version: str, apply: Callable[[], object]) -> list[RequestOutput]:
        """New weights: every request is taken out, `apply` changes the weights, a new cache generation
        starts (`set_weight_version`), and each request starts again from its prompt; a stream that sent
        tokens, or one pinned to the old version, ends instead. The outputs of those ended or restarted."""
        outputs: list[RequestOutput] = []
        again: list[tuple[EngineRequest, LoRAAdapter | None]] = []
        for gid in self.groups.ids():
            seqs = self.groups.get(gid)
            added, sent = self.groups.added(gid), any(s.output_token_ids for s in seqs)
            ended = self.abort_groups([gid])
            if added is None or added.weight_version is not None or (sent and not added.restartable):
                outputs += ended
                continue
            if sent:
                outputs += [stopped_output(s, self.weight_version, restart=True) for s in seqs]
            again.append((added, seqs[0].lora))
        apply()
        self.runner.model.repack_linears()  # its packed copies are of the old values
        self.set_weight_version(version)
        for a, lora in again:  # with the new weights and keys, each under the adapter it began with
            # KV pulled before the swap is of the old weights: it never lands (the swap's reset refuses it too)
            self.submit(dataclasses.replace(a, restartable=True, remote_kv=None), lora)
        return outputs

    # ---- LoRA adapters -----------------------------------------------------------------------------
    def load_lora(self, name: str, path: str, inplace: bool, order: int | None = None) -> LoRAAdapter:
        """Read and serve an adapter, beside the steps (`LoRARegistry.load`); `order`: the operation's number
        (`ops.LoadLoRA.order`), a new one for a direct call."""
        if not self.config.enable_lora:
            raise LoRAError("LoRA adapters are off: start the daemon with --enable-lora")
        return self.loras.load(name, path, inplace, next_lora_order() if order is None else order)

    def unload_lora(self, name: str, order: int | None = None) -> bool:
        """Stop serving an adapter (False: none of that name, or a later load of it came first). Its running
        requests finish with it."""
        return self.loras.remove(name, next_lora_order() if order is None else order)

    def set_weight_version(self, version: str) -> None:
        """A new cache generation: nothing indexed before is reachable, every key from now on has it."""
        self.weight_version = self._weight_key = version
        for gid in self.paused.held:
            for seq in self.groups.get(gid):
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
            pending = {i for i in pending if i in self.groups}
        return [outputs[i] for i in ids]

    def close(self) -> None:
        if self.kv_events is not None:
            self.kv_events.close()
        if self.kv.offload is not None:
            self.kv.offload.close()
