"""Which pod rank holds which prefix block, as the pods' KV events say.

Entries are kept per holder: a (pod name, data-parallel rank) pair in the router, since each rank of a
data-parallel pod has its own KV cache and its own event stream (any hashable names one). A holder's entry is exactly the set of block keys its engine has indexed, kept by applying its events in
sequence order (stored adds, removed drops, all-cleared empties). When events were lost and cannot be
replayed, the pod's entry is emptied and rebuilt from the events that follow: from then on it holds a
subset of the truth, so the router may under-predict a hit but never predicts one that is not there.
"""

from __future__ import annotations

import asyncio
from collections.abc import Hashable, Iterable

from kvpilot.daemon.engine.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch

Holder = Hashable  # (pod name, rank) in the router


class PrefixIndex:
    def __init__(self) -> None:
        self._blocks: dict[Holder, set[bytes]] = {}  # pod -> keys it holds
        self._holders: dict[bytes, set[Holder]] = {}  # key -> pods holding it
        self._clears: dict[Holder, int] = {}  # pod -> AllBlocksCleared events applied so far
        self._distrusted: set[Holder] = set()  # pods whose entries stay empty until their next clear
        self._cleared = asyncio.Event()  # set (and replaced) whenever a pod reports AllBlocksCleared

    # ---- updates -------------------------------------------------------------------------------
    def apply(self, pod: Holder, batch: EventBatch) -> None:
        for ev in batch.events:
            if pod in self._distrusted and not isinstance(ev, AllBlocksCleared):
                continue
            if isinstance(ev, BlockStored):
                self.store(pod, ev.block_hashes)
            elif isinstance(ev, BlockRemoved):
                self.remove(pod, ev.block_hashes)
            elif isinstance(ev, AllBlocksCleared):
                self.clear(pod)
                self._distrusted.discard(pod)
                self._clears[pod] = self._clears.get(pod, 0) + 1
                self._cleared.set()
                self._cleared = asyncio.Event()

    def store(self, pod: Holder, keys: Iterable[bytes]) -> None:
        held = self._blocks.setdefault(pod, set())
        for k in keys:
            held.add(k)
            self._holders.setdefault(k, set()).add(pod)

    def remove(self, pod: Holder, keys: Iterable[bytes]) -> None:
        held = self._blocks.get(pod)
        if not held:
            return
        for k in keys:
            if k in held:
                held.discard(k)
                self._drop_holder(k, pod)

    def clear(self, pod: Holder) -> None:
        for k in self._blocks.pop(pod, ()):
            self._drop_holder(k, pod)

    def distrust(self, pod: Holder) -> None:
        """Empty the pod's entries and ignore what it stores until it reports AllBlocksCleared: for a
        pod that was reset but whose clear event has not arrived (events sent before the reset may
        still be on their way)."""
        self.clear(pod)
        self._distrusted.add(pod)

    def _drop_holder(self, key: bytes, pod: Holder) -> None:
        holders = self._holders.get(key)
        if holders is not None:
            holders.discard(pod)
            if not holders:
                del self._holders[key]

    # ---- queries -------------------------------------------------------------------------------
    def num_blocks(self, pod: Holder) -> int:
        return len(self._blocks.get(pod, ()))

    def blocks_of(self, holders: Iterable[Holder]) -> int:
        """Blocks indexed for a pod: its ranks' entries together."""
        return sum(self.num_blocks(h) for h in holders)

    def clears(self, pod: Holder) -> int:
        return self._clears.get(pod, 0)

    def matched_blocks(self, keys: list[bytes], pods: Iterable[Holder]) -> dict[Holder, int]:
        """For each pod, how many leading keys it holds without a gap (the engine stops at its first
        miss too)."""
        out = {p: 0 for p in pods}
        alive = set(out)
        for i, k in enumerate(keys):
            alive &= self._holders.get(k, set())
            if not alive:
                break
            for p in alive:
                out[p] = i + 1
        return out

    async def wait_cleared(self, pod: Holder, after: int, timeout: float) -> bool:
        """True once `pod` has reported more than `after` AllBlocksCleared events (within `timeout`)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while self.clears(pod) <= after:
            remaining = deadline - loop.time()
            if remaining <= 0:
                return False
            try:
                await asyncio.wait_for(self._cleared.wait(), remaining)
            except TimeoutError:
                return False
        return True
