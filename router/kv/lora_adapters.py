"""The LoRA adapters a kvpilot pod serves, as the router keys their prompts.

A daemon keys an adapter's blocks with the adapter's name and the digest of its files (`kvpilot/kv/block_keys.py`,
`("lora", name, digest)`), and its `GET /health` names each adapter's digest (`lora_adapters`). The router
reads it with every probe, so an adapter loaded, reloaded in place (a new digest) or unloaded at run time
is followed within a probe interval; until then a request for it is scored by the identity the router last
saw, which at worst predicts a hit the pod no longer has. What a pod sends is checked: at most
MAX_ADAPTERS names of at most MAX_LORA_NAME_CHARS characters, each with a 64-hex-digit digest; an entry
that is anything else is left out (a request for that adapter is not predicted there).
"""

from __future__ import annotations

import json
import re

from kvpilot.kv.block_keys import LoRAKey
from kvpilot.kv.events import MAX_LORA_NAME_CHARS

MAX_ADAPTERS = 256
_DIGEST = re.compile(r"[0-9a-f]{64}")


def adapters_from_health(raw: bytes | None) -> dict[str, LoRAKey]:
    """The adapters a kvpilot pod's /health reply names (none: not a JSON object, no `lora_adapters`, or
    cut off at its size cap)."""
    if raw is None:
        return {}
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError):
        return {}
    named = body.get("lora_adapters") if isinstance(body, dict) else None
    if not isinstance(named, dict):
        return {}
    out = {}
    for name, digest in list(named.items())[:MAX_ADAPTERS]:
        if 0 < len(name) <= MAX_LORA_NAME_CHARS and isinstance(digest, str) and _DIGEST.fullmatch(digest):
            out[name] = LoRAKey(name, digest)
    return out
