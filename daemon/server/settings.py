"""The HTTP server's settings. Each field with `flag(...)` metadata is a `kvpilot serve` flag
(kvpilot/cli/flags.py); its default here is the flag's. Light on purpose: `kvpilot --help` imports it."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvpilot.cli.flags import flag
from kvpilot.daemon.server.tenants import tenant_of
from kvpilot.serving.http_limits import ConnectionLimits


@dataclass(slots=True)
class ServerSettings:
    host: str = field(default="0.0.0.0", metadata=flag("address to listen on"))
    port: int = field(default=8000, metadata=flag("port to listen on"))
    served_model_names: list[str] = field(
        default_factory=list,
        metadata=flag(
            "model name(s) clients use; the first is reported",
            name="--served-model-name",
            unset="the model's name",
        ),
    )
    admin_token: str | None = None  # from --admin-token-file or $KVPILOT_ADMIN_TOKEN (admin_token.py)
    # From --tenant-tokens-file (tenants.py): token SHA-256 -> tenant; None: no tenancy, salts as sent.
    tenant_tokens: dict[bytes, str] | None = None
    max_body_bytes: int = field(  # a full 128k-token context as JSON fits well below the default
        default=4 << 20,
        metadata=flag("larger request bodies are refused with 413", name="--max-request-body-bytes"),
    )
    shutdown_timeout: float = field(
        default=30.0, metadata=flag("seconds in-flight requests get to finish after SIGTERM")
    )
    request_timeout: float | None = field(
        default=None,
        metadata=flag(
            "seconds a generation may take from arrival; later ones are aborted with 504", unset="none"
        ),
    )
    reset_timeout: float = 60.0  # a rank whose reset has not answered by then fails the reset (500)
    weight_update_timeout: float = (
        900.0  # a rank whose weight operation (a stage: reading a checkpoint) is slower fails it
    )
    text_workers: int = 2  # threads that tokenize, template and detokenize
    max_pending_prepare: int = 64  # requests waiting to be tokenized beyond which new ones get 503
    limits: ConnectionLimits = field(default_factory=ConnectionLimits)  # flags of their own (http_limits)

    def validate(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError("port must be between 0 and 65535")
        if self.max_body_bytes < 1:
            raise ValueError("max_body_bytes must be positive")
        if self.shutdown_timeout < 0:
            raise ValueError("shutdown_timeout must not be negative")
        if self.request_timeout is not None and not self.request_timeout > 0:
            raise ValueError("request_timeout must be a positive number of seconds")
        if self.tenant_tokens is not None and self.admin_token is None:
            raise ValueError(
                "--tenant-tokens-file needs an admin token (--admin-token-file or $KVPILOT_ADMIN_TOKEN): "
                "without one the admin routes are open to every tenant"
            )
        if self.tenant_tokens is not None and self.admin_token is not None:
            tenant = tenant_of(self.admin_token.encode(), self.tenant_tokens)
            if tenant is not None:
                # Such a tenant would hold the admin routes, and the admin's requests would be salted as hers.
                raise ValueError(
                    f"tenant {tenant}'s token in --tenant-tokens-file is the admin token: give the tenant a "
                    "token of its own"
                )
        if self.reset_timeout <= 0 or self.text_workers < 1 or self.max_pending_prepare < 1:
            raise ValueError("reset_timeout, text_workers and max_pending_prepare must be positive")
        self.limits.validate()
