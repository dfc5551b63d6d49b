"""What a fan-out calls (`Target`) and how (`CallSettings`; a reset's, `ResetSettings`)."""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import urlsplit

from kvpilot.kv.reset_scope import ResetScope


@dataclass(frozen=True, slots=True)
class Target:
    """One endpoint to reset: a pod as resolved when the reset starts, or any URL."""

    name: str
    ip: str = ""
    node: str = ""
    uid: str = ""  # the pod's identity, for the caller's pod_gone check; not used here
    url: str = ""  # base URL (scheme://host:port); empty: http://ip:settings.port
    skip_reason: str = ""  # non-empty: not called, reported Skipped with this reason


@dataclass(frozen=True, slots=True)
class CallSettings:
    """How pods are called, whatever the call: a reset, a weight update's phase, a catch-up's question."""

    port: int = 8000
    token: str | None = None
    timeout_s: float = 60.0
    request_timeout_s: float = 10.0
    max_concurrency: int = 64
    retries_per_pod: int = 3
    backoff_base_s: float = 0.2
    backoff_max_s: float = 5.0
    progress_interval_s: float = 1.0
    shutdown_grace_s: float = 5.0


@dataclass(frozen=True, slots=True)
class ResetSettings(CallSettings):
    """A reset's calls: what each pod's engine is asked to clear, and whether a canary proves it cold."""

    engine: str = "kvpilot"
    reset_running_requests: bool = False
    reset_external: bool = True  # vLLM: clear its offload tier and KV connectors too (engines.py)
    verify: bool = False  # prove each pod cold with a canary prompt (verify.py)
    scope: ResetScope | None = None  # kvpilot pods: reset one adapter's, salt's or weight version's blocks


def address(target: Target, settings: CallSettings) -> tuple[str, int, bool, str]:
    """(host, port, TLS, path prefix) of a target: its pod IP and the settings' port, or its base URL's."""
    if not target.url:
        return target.ip, settings.port, False, ""
    parts = urlsplit(target.url)
    tls = parts.scheme == "https"
    return parts.hostname or "", parts.port or (443 if tls else 80), tls, parts.path.rstrip("/")
