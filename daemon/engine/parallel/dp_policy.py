"""Which data-parallel rank gets a request: the rank that most likely holds its prefix, unless busier.

Pure logic (no processes, no I/O); only the daemon's data-parallel loop uses it (the fleet router scores
pods by their KV events instead, in `router/routing/policy.py`). Each rank's recent prefixes are remembered as
block keys (`kvpilot/kv/block_keys.py`, the same keys the engines index), bounded LRU per rank; a reset forgets
them. Load is the caller's count of open requests.

Choice: among the live ranks whose load is within `load_slack` of the least loaded one, the one whose
remembered keys cover the longest prefix of the prompt; ties go to the least loaded, then round robin
(so unrelated prompts spread their prefixes over every rank's cache even when they arrive one by one). So a shared system prompt sticks to one rank until that rank falls `load_slack` requests behind,
and then spreads (and is remembered on the next rank too).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Sequence

from kvpilot.kv.block_keys import BlockHash

DEFAULT_LOAD_SLACK = 4
DEFAULT_KEYS_PER_RANK = 65536  # 32 bytes each: ~2 MiB of keys per rank at most


class PrefixAwarePolicy:
    def __init__(
        self,
        num_ranks: int,
        load_slack: int = DEFAULT_LOAD_SLACK,
        keys_per_rank: int = DEFAULT_KEYS_PER_RANK,
    ) -> None:
        if num_ranks < 1:
            raise ValueError("num_ranks must be positive")
        self.load_slack = load_slack
        self.keys_per_rank = keys_per_rank
        self._keys: list[OrderedDict[BlockHash, None]] = [OrderedDict() for _ in range(num_ranks)]
        self._next = 0  # round robin among equals starts here

    def choose(self, keys: Sequence[BlockHash], loads: Sequence[int], alive: Collection[int]) -> int:
        """The rank for a prompt with these block keys; remembers the keys on it."""
        if not alive:
            raise ValueError("no live rank to choose from")
        least = min(loads[r] for r in alive)
        candidates = [r for r in alive if loads[r] <= least + self.load_slack]
        n = len(self._keys)
        rank = max(
            candidates, key=lambda r: (self.matched_blocks(r, keys), -loads[r], -((r - self._next) % n))
        )
        self._next = (rank + 1) % n
        self.remember(rank, keys)
        return rank

    def matched_blocks(self, rank: int, keys: Sequence[BlockHash]) -> int:
        """How many leading keys the rank is remembered to hold."""
        seen = self._keys[rank]
        n = 0
        for key in keys:
            if key not in seen:
                break
            n += 1
        return n

    def forget(self, rank: int | None = None) -> None:
        """After a reset (of one rank, or of all): nothing cached before it can be matched."""
        for r, seen in enumerate(self._keys):
            if rank is None or r == rank:
                seen.clear()

    def remember(self, rank: int, keys: Sequence[BlockHash]) -> None:
        """The prompt went to `rank` (chosen here, or by the caller)."""
        seen = self._keys[rank]
        for key in keys:
            seen[key] = None
            seen.move_to_end(key)
        while len(seen) > self.keys_per_rank:
            seen.popitem(last=False)
