"""Continuous batching with chunked prefill under a token budget.

Each step: running requests first (decodes and unfinished prefill chunks, oldest first), then waiting
requests admitted in arrival order after a prefix-cache lookup, while the token budget, `max_num_seqs`
and the block pool allow. When blocks run out, the newest running request is preempted: its blocks are
freed and it goes back to the head of the queue to be recomputed later, never dropped.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from kvpilot.daemon.engine.kv.cache_manager import KVCacheManager, KVTransfers
from kvpilot.daemon.engine.outputs import TokenLogprob
from kvpilot.daemon.engine.request import Request, RequestStatus
from kvpilot.protocol.pins import PinResult

# A request that wants prompt logprobs needs the LM head on every prompt position: cap its prefill
# chunks so one step's [tokens, vocab] fp32 logits stay small (256 x 49k x 4 B = 48 MiB).
PROMPT_LOGPROBS_CHUNK = 256


@dataclass(frozen=True, slots=True)
class ScheduledChunk:
    """`num_tokens` tokens of `request` starting at `start` run this step; `sample` when they reach the
    end of its tokens, so the step produces its next token."""

    request: Request
    start: int
    num_tokens: int
    block_ids: list[int]
    sample: bool

    @property
    def logits_from(self) -> int:
        """First position whose logits the step needs: every prompt position still to be scored
        for prompt logprobs, else the last one when it samples, else none (the chunk's end)."""
        end = self.start + self.num_tokens
        if self.request.prompt_logprobs is not None and self.start < self.request.num_prompt_tokens - 1:
            return self.start
        return end - 1 if self.sample else end


@dataclass(slots=True)
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    num_preempted: int = 0
    # (source, destination) KV block copies to make before the forward pass (copy on write).
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    # Blocks to read into the offload tiers, then to write back from them, before the forward pass.
    kv_transfers: KVTransfers | None = None


class Scheduler:
    def __init__(
        self, kv: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int
    ) -> None:
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        self.max_loras: int | None = None  # distinct LoRA adapters in one step (None: LoRA is off)
        # Prefills for a remote decode that ended this step, still holding their blocks: the engine copies
        # their KV off the pool (`take_handoffs`), then frees them.
        self._handoffs: list[Request] = []

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        plan: list[tuple[Request, int]] = []

        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(req.num_tokens - req.num_computed_tokens, budget, _chunk_cap(req))
            while not self.kv.allocate_slots(req, n):
                victim = self.running.pop()
                self._preempt(victim)
                out.num_preempted += 1
                if victim is req:
                    break
            else:
                self.kv.cache_full_blocks(req, req.num_computed_tokens + n)
                plan.append((req, n))
                budget -= n
                i += 1

        # Admitting while preempting would only thrash: the freed blocks go to the preempted first.
        # A request of an adapter beyond --max-loras is passed over (it keeps its place in the queue), as
        # vLLM does, so the base model's and the running adapters' requests behind it are not held up.
        passed_over: list[Request] = []
        while (
            out.num_preempted == 0 and self.waiting and budget > 0 and len(self.running) < self.max_num_seqs
        ):
            req = self.waiting[0]
            if not self._lora_fits(req):
                passed_over.append(self.waiting.popleft())
                continue
            hit = self.kv.find_prefix(req)
            if hit.pending:  # its prefix is on its way from disk: admitted on a later step, in order
                break
            n = min(req.num_tokens - hit.num_tokens, budget, _chunk_cap(req))
            if not self.kv.allocate_slots(req, n, hit):
                break
            self.waiting.popleft()
            if req.num_cached_tokens < 0:  # first admission: a recompute after preemption is not a query
                req.num_cached_tokens = hit.num_tokens
                self.kv.record_query(req.num_tokens, hit)
            req.num_computed_tokens = hit.num_tokens
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            self.kv.cache_full_blocks(req, req.num_computed_tokens + n)
            plan.append((req, n))
            budget -= n

        self.waiting.extendleft(reversed(passed_over))
        for req, n in plan:
            start = req.num_computed_tokens
            sample = start + n == req.num_tokens
            out.chunks.append(ScheduledChunk(req, start, n, self.kv.block_ids(req), sample))
        out.block_copies = self.kv.take_pending_copies()
        out.kv_transfers = self.kv.take_transfers()
        return out

    def _lora_fits(self, req: Request) -> bool:
        if req.lora is None or self.max_loras is None:
            return True
        active = {r.lora.identity for r in self.running if r.lora is not None}
        return req.lora.identity in active or len(active) < self.max_loras

    def update(
        self, out: SchedulerOutput, sampled: dict[str, tuple[int, TokenLogprob | None]]
    ) -> list[Request]:
        """Advance the scheduled requests by what the model computed; returns those that produced an
        output (a token, or their end): the sampled ones and the sequences forked off them."""
        advanced = []
        for chunk in out.chunks:
            req = chunk.request
            req.num_computed_tokens = chunk.start + chunk.num_tokens
            if not chunk.sample:
                continue
            if req.params.max_tokens == 0:  # the prompt is scored; nothing is generated
                self._end(req, "length")
                advanced.append(req)
                continue
            forks, req.forks = (req.forks, []) if not req.output_token_ids else ([], req.forks)
            for child in forks:  # share the prompt's blocks before the parent may finish and free them
                self.kv.fork(req, child)
                child.num_computed_tokens = req.num_computed_tokens
                child.num_cached_tokens = req.num_cached_tokens
                child.status = RequestStatus.RUNNING
                self.running.append(child)
            for seq in (req, *forks):
                self._advance(seq, *sampled[seq.request_id])
                advanced.append(seq)
        return advanced

    def _advance(self, req: Request, token_id: int, logprob: TokenLogprob | None) -> None:
        req.append_token(token_id)
        if req.pin_prefix and req.pinned is None:
            # At its first token the prompt is computed and indexed: pinned now, while the request holds its
            # blocks, and said in every output from here on (a stream the server ends at a stop string too).
            req.pinned = self.kv.pin_prompt(req)
        if logprob is not None:
            req.cumulative_logprob += logprob.logprob
            if req.params.logprobs is not None:
                req.new_logprobs.append(logprob)
        reason = req.check_stop(self.max_model_len)
        if reason is not None:
            self._end(req, reason)

    def abort(self, request_id: str) -> Request | None:
        for req in self.waiting:
            if req.request_id == request_id:
                self.waiting.remove(req)
                self.kv.free(req)  # a disk read on its way for it is dropped
                req.finish_reason = "abort"
                req.status = RequestStatus.FINISHED
                return req
        for req in self.running:
            if req.request_id == request_id:
                self._end(req, "abort")
                return req
        return None

    def preempt_running(self, which: Callable[[Request], bool] | None = None) -> int:
        """Send every running request (or those `which` names) back to be recomputed, in their original
        order; returns how many."""
        chosen = [r for r in self.running if which is None or which(r)]
        for req in reversed(chosen):
            self.running.remove(req)
            self._preempt(req)
        return len(chosen)

    def _preempt(self, req: Request) -> None:
        self.kv.free(req)
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        req.status = RequestStatus.WAITING
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def _end(self, req: Request, reason: str) -> None:
        req.finish_reason = reason
        self.running.remove(req)
        req.status = RequestStatus.FINISHED
        if req.pin_prefix and req.pinned is None:  # ended before its first token (scored prompt, abort)
            req.pinned = PinResult(False, reason="aborted") if reason == "abort" else self.kv.pin_prompt(req)
        if req.kv_hold is not None and reason != "abort":
            self._handoffs.append(req)
            return
        self.kv.free(req)

    def take_handoffs(self) -> list[Request]:
        """The ended prefills whose KV a remote decode will pull, their blocks still held: the caller
        copies them off the pool before the next step and frees them (`kv.free`)."""
        out, self._handoffs = self._handoffs, []
        return out


def _chunk_cap(req: Request) -> int:
    return PROMPT_LOGPROBS_CHUNK if req.prompt_logprobs is not None else 1 << 62
