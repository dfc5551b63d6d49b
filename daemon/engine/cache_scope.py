"""What a cached block was computed under besides its tokens, and which of those a scoped reset names.

A block's key folds in the weights' version, the LoRA adapter and the `cache_salt` of the request that
computed it (`block_keys.py`); `CacheScope` is that triple. The pool keeps one prefix index per scope
(`block_pool.py`), so a reset of one adapter, salt or weight version (`ResetScope`, what
`POST /reset_prefix_cache` names) drops whole indexes at once and leaves the others warm.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from kvpilot.block_keys import LoRAKey
from kvpilot.protocol.requests import ResetScope


@dataclass(frozen=True, slots=True)
class CacheScope:
    weight_key: str | None  # None: the unnamed initial weights
    lora: LoRAKey | None
    cache_salt: str | None


def scope_filter(reset: ResetScope, initial_version: str) -> Callable[[CacheScope], bool]:
    """Whether a scope is one `reset` names: it agrees with every field given. The adapter is matched by
    name (every version of it); the unnamed initial weights by the engine's `initial_version`."""

    def match(scope: CacheScope) -> bool:
        if reset.lora_name is not None and (scope.lora is None or scope.lora.name != reset.lora_name):
            return False
        if reset.cache_salt is not None and scope.cache_salt != reset.cache_salt:
            return False
        return reset.weight_version is None or (scope.weight_key or initial_version) == reset.weight_version

    return match
