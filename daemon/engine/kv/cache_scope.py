"""What a cached block was computed under besides its tokens, and which of those a scoped reset names.

A block's key folds in the weights' version, the LoRA adapter and the `cache_salt` of the request that
computed it (`block_keys.py`); `CacheScope` is that triple. The pool keeps one prefix index per scope
(`block_pool.py`), so a reset of one adapter, salt or weight version (`ResetScope`, what
`POST /reset_prefix_cache` names) drops whole indexes at once and leaves the others warm.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvpilot.kv.block_keys import LoRAKey
from kvpilot.kv.reset_scope import TENANT_SALT_PREFIX, ResetScope


@dataclass(frozen=True, slots=True)
class CacheScope:
    weight_key: str | None  # None: the unnamed initial weights
    lora: LoRAKey | None
    cache_salt: str | None


def scope_record(scope: CacheScope) -> dict[str, object]:
    """The scope as JSON (the disk tier writes it beside its blocks: `kv/offload.py`)."""
    lora = None if scope.lora is None else {"name": scope.lora.name, "digest": scope.lora.digest}
    return {"weight_key": scope.weight_key, "lora": lora, "cache_salt": scope.cache_salt}


def scope_from_record(record: dict[str, Any]) -> CacheScope:
    """`scope_record`'s JSON read back; TypeError or KeyError for anything else."""
    lora = record["lora"]
    scope = CacheScope(
        record["weight_key"],
        None if lora is None else LoRAKey(lora["name"], lora["digest"]),
        record["cache_salt"],
    )
    strings = [
        scope.weight_key,
        scope.cache_salt,
        *([] if scope.lora is None else [scope.lora.name, scope.lora.digest]),
    ]
    if not all(v is None or isinstance(v, str) for v in strings):
        raise TypeError("a scope's fields are strings or null")
    return scope


def scope_dir_name(scope: CacheScope) -> str:
    """A directory name for the scope: a digest of its record (salts and names may hold any character)."""
    raw = json.dumps(scope_record(scope), sort_keys=True).encode()
    return "s-" + hashlib.sha256(raw).hexdigest()[:32]


def scope_filter(reset: ResetScope, initial_version: str) -> Callable[[CacheScope], bool]:
    """Whether a scope is one `reset` names: it agrees with every field given. The adapter is matched by
    name (every version of it); the unnamed initial weights by the engine's `initial_version`."""

    def match(scope: CacheScope) -> bool:
        if reset.lora_name is not None and (scope.lora is None or scope.lora.name != reset.lora_name):
            return False
        if reset.cache_salt is not None and scope.cache_salt != reset.cache_salt:
            return False
        if reset.tenant is not None and not is_tenants_salt(scope.cache_salt, reset.tenant):
            return False
        return reset.weight_version is None or (scope.weight_key or initial_version) == reset.weight_version

    return match


def is_tenants_salt(salt: str | None, tenant: str) -> bool:
    """Whether blocks of `salt` are the tenant's: its unsalted ones or one of its own partitions."""
    own = TENANT_SALT_PREFIX + tenant
    return salt is not None and (salt == own or salt.startswith(own + ":"))
