"""vLLM's prefill/decode disaggregation fields, as the daemon serves them and the router sends them
(docs/disaggregation.md): `kv_transfer_params` on a request (what it asks) and on a prefill's reply (where the
prompt's KV is held)."""

from __future__ import annotations

from typing import Any

from kvpilot.protocol import JSONObject

KV_TRANSFER = "kv_transfer_params"
ASKS = ("do_remote_decode", "do_remote_prefill")
_NOTHING: tuple[object, ...] = (None, False, 0, "", [], {})

# What a prefill asks for: compute the prompt and hold its KV for a decode elsewhere. vllm-router 0.1.17's
# fields exactly; the prefill pod's reply fills in the rest.
PREFILL_ASK: JSONObject = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


def asks(params: dict[str, Any] | None, what: str | None = None) -> bool:
    """Whether `params` ask for a remote decode or prefill (`what`: that one; None: either). All false or
    null asks nothing, as vLLM reads it."""
    return params is not None and any(params.get(k) not in _NOTHING for k in ((what,) if what else ASKS))
