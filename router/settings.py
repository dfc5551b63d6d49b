"""The router's settings. Each field with `flag(...)` metadata is a `kvpilot router` flag
(kvpilot/config_flags.py); its default here is the flag's. Light on purpose: `kvpilot --help` imports it."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvpilot.config_flags import flag

POLICIES = ("prefix-aware", "round-robin", "least-load")  # policy.py; app.make_policy builds them


@dataclass(slots=True)
class RouterSettings:
    host: str = field(default="0.0.0.0", metadata=flag("address to listen on"))
    port: int = field(default=8080, metadata=flag("port to listen on"))
    policy: str = field(default="prefix-aware", metadata=flag("how a pod is chosen", choices=POLICIES))
    admin_token: str | None = None  # from --admin-token-file or $KVPILOT_ADMIN_TOKEN (auth.py)
    reset_timeout_s: float = field(
        default=60.0,
        metadata=flag(
            "seconds a fleet reset may take before unfinished pods count as failed", name="--reset-timeout"
        ),
    )
    # After a pod's reset, how long its AllBlocksCleared event may take to arrive before the router
    # empties that pod's entries itself (and ignores its events until the clear arrives).
    clear_wait_s: float = 5.0
    max_body_bytes: int = 4 << 20

    def validate(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError("port must be between 0 and 65535")
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {', '.join(POLICIES)}")
        if self.reset_timeout_s <= 0 or self.clear_wait_s < 0 or self.max_body_bytes < 1:
            raise ValueError("reset_timeout_s and max_body_bytes must be positive, clear_wait_s not negative")
