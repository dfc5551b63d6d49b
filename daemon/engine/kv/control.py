"""The prefix cache's operations between two steps: a reset (all of it, or one scope) and its stats.
It answers for the pool and every tier below it, and counts the resets it made."""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import TYPE_CHECKING

from kvpilot.daemon.engine.kv.cache_manager import KVCacheManager
from kvpilot.daemon.engine.kv.cache_scope import scope_filter
from kvpilot.daemon.engine.outputs import CacheStats, ResetResult
from kvpilot.daemon.engine.request import Request
from kvpilot.daemon.engine.scheduler import Scheduler
from kvpilot.daemon.engine.weights.ops import INITIAL_VERSION
from kvpilot.kv.reset_scope import ResetScope

if TYPE_CHECKING:
    from kvpilot.daemon.engine.kv.publisher import KVEventPublisher
    from kvpilot.daemon.kv_transfer.held import HeldKV


class CacheControl:
    def __init__(
        self,
        kv: KVCacheManager,
        scheduler: Scheduler,
        kv_events: KVEventPublisher | None,
        block_size: int,
        max_loras: int,
        held: HeldKV | None = None,
    ) -> None:
        """`held`: a producer's holds for remote decodes (kv_transfer/held.py), which every reset covers."""
        self.kv, self.scheduler, self.kv_events, self.held = kv, scheduler, kv_events, held
        self.block_size, self.max_loras = block_size, max_loras
        self.resets = 0
        self.last_reset_time: float | None = None

    def reset(self, reset_running_requests: bool = False, scope: ResetScope | None = None) -> ResetResult:
        """Make every cached block unreachable now, or with `scope` those of one adapter, salt or weight
        version. Running requests keep the KV they hold (never re-indexed); with `reset_running_requests`
        they (those of the scope) are preempted and recomputed instead."""
        start = time.perf_counter()
        in_flight = len(self.scheduler.running) + len(self.scheduler.waiting)
        if scope is None:
            preempted = self.scheduler.preempt_running() if reset_running_requests else 0
            evicted = self.kv.reset_prefix_cache()  # every tier
            unpinned = self.kv.pool.unpin()  # cold means cold: the dropped blocks are free now
            dropped = self.held.drop() if self.held is not None else None  # never waits for a pull
        else:
            match = scope_filter(scope, INITIAL_VERSION)
            preempted = (
                self.scheduler.preempt_running(lambda r: match(r.cache_scope))
                if reset_running_requests
                else 0
            )
            evicted = self.kv.reset_prefix_cache(match)
            unpinned = self.kv.pool.unpin(match)
            dropped = self.held.drop(match) if self.held is not None else None
        self.resets += 1
        self.last_reset_time = time.time()
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
            unpinned_blocks=unpinned,
            dropped_holds=dropped,
        )

    def unpin(self, scope: ResetScope | None = None) -> int:
        """Let go of every pin, or those of one scope (named as a scoped reset names it); the blocks stay
        cached, evicted in turn like any other. How many were pinned."""
        return self.kv.pool.unpin(None if scope is None else scope_filter(scope, INITIAL_VERSION))

    def stats(self) -> CacheStats:
        pool = self.kv.pool
        return CacheStats(
            epoch=pool.epoch,
            block_size=self.block_size,
            blocks_total=pool.num_blocks,
            blocks_free=pool.num_free_blocks - pool.num_cached_blocks,
            blocks_cached=pool.num_cached_blocks,
            blocks_used=pool.num_used_blocks,
            query_tokens=self.kv.query_tokens,
            hit_tokens=self.kv.hit_tokens,
            resets=self.resets,
            last_reset_time=self.last_reset_time,
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            num_preemptions=self.scheduler.num_preemptions,
            offload=self.kv.offload.stats() if self.kv.offload is not None else (),
            max_loras=self.max_loras,
            lora_running=_adapter_names(self.scheduler.running),
            lora_waiting=_adapter_names(self.scheduler.waiting),
            pinned_blocks=pool.num_pinned_blocks,
            pinned_blocks_cap=pool.pin_cap,
            pins_refused=pool.pins_refused,
            eviction_policy=pool.eviction_policy,
        )


def _adapter_names(requests: Iterable[Request]) -> tuple[str, ...]:
    return tuple(sorted({r.lora.name for r in requests if r.lora is not None}))
