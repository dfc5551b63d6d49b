"""`--kv-transfer-config`, vLLM's JSON shape: which connector, which role, and the connector's settings."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

CONNECTOR = "KvpilotConnector"
PRODUCER, CONSUMER, BOTH = "kv_producer", "kv_consumer", "kv_both"
ROLES = (PRODUCER, CONSUMER, BOTH)
DEFAULT_PORT = 14579  # vLLM's default kv_port


@dataclass(frozen=True, slots=True)
class KVTransferConfig:
    role: str
    port: int = DEFAULT_PORT  # where a producer serves pulls (0: any free port, for tests)
    host: str = "0.0.0.0"
    # A held prompt nobody pulled within this long is dropped. vLLM's VLLM_NIXL_ABORT_REQUEST_TIMEOUT is
    # 480 s; a decode pod pulls within a second of the prefill's reply, so minutes are ample.
    hold_timeout_s: float = 120.0
    max_held_mib: float = 1024.0  # past it, the oldest holds are dropped
    pull_timeout_s: float = 30.0  # a consumer's whole pull, connect to the last byte
    # A consumer's pulls at once; past it a decode computes its prompt (each pull holds up to a whole
    # context's KV in memory while it lands).
    max_pulls: int = 16

    @property
    def produces(self) -> bool:
        return self.role in (PRODUCER, BOTH)

    @property
    def consumes(self) -> bool:
        return self.role in (CONSUMER, BOTH)

    @property
    def max_held_bytes(self) -> int:
        return int(self.max_held_mib * (1 << 20))


_SETTINGS: dict[str, type] = {
    "port": int,
    "host": str,
    "hold_timeout_s": float,
    "max_held_mib": float,
    "pull_timeout_s": float,
    "max_pulls": int,
}


def parse_kv_transfer_config(text: str | None) -> KVTransferConfig | None:
    """The config `--kv-transfer-config` gives (None: off); ValueError naming what is wrong."""
    if not text:
        return None
    try:
        raw = json.loads(text)
    except ValueError:
        raise ValueError(f"--kv-transfer-config is not JSON: {text!r}") from None
    if not isinstance(raw, dict):
        raise ValueError("--kv-transfer-config must be a JSON object")
    connector = raw.get("kv_connector")
    if connector != CONNECTOR:
        raise ValueError(f'--kv-transfer-config: "kv_connector" must be "{CONNECTOR}", got {connector!r}')
    role = raw.get("kv_role")
    if role not in ROLES:
        raise ValueError(f'--kv-transfer-config: "kv_role" must be one of {", ".join(ROLES)}, got {role!r}')
    extra = raw.get("kv_connector_extra_config") or {}
    if not isinstance(extra, dict):
        raise ValueError('--kv-transfer-config: "kv_connector_extra_config" must be an object')
    settings: dict[str, Any] = {}
    for key, value in extra.items():
        kind = _SETTINGS.get(key)
        if kind is None:
            raise ValueError(
                f'--kv-transfer-config: unknown "kv_connector_extra_config" key {key!r} '
                f"(known: {', '.join(_SETTINGS)})"
            )
        if isinstance(value, bool) or not isinstance(value, (int, float) if kind is float else kind):
            raise ValueError(f'--kv-transfer-config: "{key}" must be a {kind.__name__}')
        settings[key] = kind(value)
    config = KVTransferConfig(role, **settings)
    if not 0 <= config.port <= 65535:
        raise ValueError('--kv-transfer-config: "port" must be 0-65535')
    for name in ("hold_timeout_s", "max_held_mib", "pull_timeout_s", "max_pulls"):
        if not getattr(config, name) > 0:
            raise ValueError(f'--kv-transfer-config: "{name}" must be positive')
    return config
