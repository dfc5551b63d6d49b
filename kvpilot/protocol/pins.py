"""The `pin_prefix` object of a chat or completion reply (a kvpilot extension, after vLLM PRs 27046/27097's
request field): what a request's pin of its prompt got. The engine makes it, the server writes it, a
warm-up reads it back from a pod (kvpilot/fanout/warmup.py sums a pod's)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class PinResult:
    """`pinned`: every block asked for is pinned; `blocks`: how many (those pinned before included);
    `reason` why not: "disabled" (no --enable-pinned-prefix), "cap" (past --pinned-prefix-cap-ratio),
    "not_cached" (no full block of the prompt is cached, e.g. a reset came first), "aborted", "tenant"
    (tenants do not pin)."""

    pinned: bool
    blocks: int = 0
    reason: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
