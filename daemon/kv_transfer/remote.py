"""A decode pod's side inside the engine: blocks pulled from a prefill pod, landed in the pool as a tier's
blocks are (`KVCacheManager.find_prefix`), and the plan of what to pull.

Landing is refused when the decode pod's cache was reset after the pull was planned (`generation`): those
blocks were computed before the reset, and cold means cold. It is skipped when the pool no longer holds the
blocks before the pulled run (a gap: a prefix cannot resume past a block it lacks). Either way the prompt is
computed here instead, and the reason counted.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from kvpilot.kv.block_keys import BlockHash

REMOTE = "remote"
# Why a pulled run was not landed (kvpilot_kv_transfer_failures_total's engine-side reasons).
LANDING_REFUSALS = ("local_reset", "gap")


@dataclass(frozen=True, slots=True)
class PullPlan:
    """What a decode request should pull: held blocks `first` to `first + count` (by the prefill's order,
    which is the prompt's), planned at the engine's reset `generation`. The blocks before `first` this
    pod's pool holds already; `count` 0: nothing worth pulling. `matched`: the held blocks whose keys are
    the prompt's own here (0 of some: the prefill pod keyed them under other weights, salt, adapter or hash
    seed, and none may be used)."""

    first: int
    count: int
    generation: int
    matched: int


@dataclass(frozen=True, slots=True)
class RemoteBlocks:
    """Pulled blocks for one request: the prompt's blocks `first` on, their keys and data
    ([blocks, layers, K/V, block_size, kv_heads, head_dim] in host memory)."""

    first: int
    keys: tuple[BlockHash, ...]
    data: torch.Tensor
    generation: int


@dataclass(slots=True)
class RemoteSource:
    """Where landed blocks come from, as the cache manager's tier hits name it: it counts what it gave."""

    name: str = REMOTE
    hit_tokens: int = 0
    landed_blocks: int = 0
    # Pulled runs not landed, by reason: every key there from the start, so a reader on another thread
    # never sees the map change size.
    refused: Counter[str] = field(default_factory=lambda: Counter(dict.fromkeys(LANDING_REFUSALS, 0)))
    on_refused: Callable[[str], None] | None = (
        None  # the server's metric (prometheus counters are thread-safe)
    )

    def refuse(self, reason: str) -> None:
        self.refused[reason] += 1
        if self.on_refused is not None:
            self.on_refused(reason)
