"""The part of the prefix cache a scoped reset clears: one neutral value that the HTTP parser makes, the
engine applies and the fan-out sends, so none of them imports another's module for it."""

from __future__ import annotations

import re
from dataclasses import dataclass

RESET_SCOPE_FIELDS = ("lora_name", "cache_salt", "weight_version", "tenant")
TENANT_SALT_PREFIX = "tenant:"  # a tenant's salts: `tenant:<name>`, and `tenant:<name>:<its own salt>`
TENANT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,62}")  # no ':', so no salt reaches another's


@dataclass(frozen=True, slots=True)
class ResetScope:
    """The blocks of the LoRA adapter `lora_name` (every version of it), of `cache_salt`, of
    `weight_version`, of `tenant` (its unsalted blocks and every partition its own salts made: the server
    salts a tenant's requests, `daemon/server/tenants.py`); given together, the blocks that are all of them
    at once."""

    lora_name: str | None = None
    cache_salt: str | None = None
    weight_version: str | None = None
    tenant: str | None = None

    def to_dict(self) -> dict[str, str]:
        return {k: v for k in RESET_SCOPE_FIELDS if (v := getattr(self, k)) is not None}
