"""Continuous batching with chunked prefill under a token budget.

Each step: running requests first (decodes and unfinished prefill chunks, oldest first), then waiting
requests admitted in arrival order after a prefix-cache lookup, while the token budget, `max_num_seqs`
and the block pool allow. When blocks run out, the newest running request is preempted: its blocks are
freed and it goes back to the head of the queue to be recomputed later, never dropped.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from kvpilot.daemon.engine.kv_cache_manager import KVCacheManager
from kvpilot.daemon.engine.request import Request, RequestStatus


@dataclass(frozen=True, slots=True)
class ScheduledChunk:
    """`num_tokens` tokens of `request` starting at `start` run this step; `sample` when they reach the
    end of its tokens, so the step produces its next token."""

    request: Request
    start: int
    num_tokens: int
    block_ids: list[int]
    sample: bool


@dataclass(slots=True)
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    num_preempted: int = 0

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)


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
            n = min(req.num_tokens - req.num_computed_tokens, budget)
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
        while (
            out.num_preempted == 0 and self.waiting and budget > 0 and len(self.running) < self.max_num_seqs
        ):
            req = self.waiting[0]
            hit = self.kv.find_prefix(req)
            n = min(req.num_tokens - hit.num_tokens, budget)
            if not self.kv.allocate_slots(req, n, hit):
                break
            self.waiting.popleft()
            if req.num_cached_tokens < 0:  # first admission: a recompute after preemption is not a query
                req.num_cached_tokens = hit.num_tokens
                self.kv.record_query(req.num_tokens, hit.num_tokens)
            req.num_computed_tokens = hit.num_tokens
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            self.kv.cache_full_blocks(req, req.num_computed_tokens + n)
            plan.append((req, n))
            budget -= n

        for req, n in plan:
            start = req.num_computed_tokens
            sample = start + n == req.num_tokens
            out.chunks.append(ScheduledChunk(req, start, n, self.kv.block_ids(req), sample))
        return out

    def update(self, out: SchedulerOutput, sampled: dict[str, int]) -> list[Request]:
        """Advance the scheduled requests by what the model computed; returns those that finished."""
        finished = []
        for chunk in out.chunks:
            req = chunk.request
            if req.status is not RequestStatus.RUNNING:
                continue  # aborted while the step ran
            req.num_computed_tokens = chunk.start + chunk.num_tokens
            if not chunk.sample:
                continue
            req.append_token(sampled[req.request_id])
            reason = req.check_stop(self.max_model_len)
            if reason is not None:
                req.finish_reason = reason
                self._finish(req)
                finished.append(req)
        return finished

    def abort(self, request_id: str) -> Request | None:
        for req in self.waiting:
            if req.request_id == request_id:
                self.waiting.remove(req)
                req.finish_reason = "abort"
                req.status = RequestStatus.FINISHED
                return req
        for req in self.running:
            if req.request_id == request_id:
                req.finish_reason = "abort"
                self._finish(req)
                return req
        return None

    def preempt_all_running(self) -> int:
        """Send every running request back to be recomputed, in their original order."""
        n = len(self.running)
        while self.running:
            self._preempt(self.running.pop())
        return n

    def _preempt(self, req: Request) -> None:
        self.kv.free(req)
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        req.status = RequestStatus.WAITING
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def _finish(self, req: Request) -> None:
        self.running.remove(req)
        req.status = RequestStatus.FINISHED
        self.kv.free(req)
