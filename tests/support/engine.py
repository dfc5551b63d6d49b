"""What the engine tests read of a running engine that the server never needs: a request by its id."""

from __future__ import annotations

from kvpilot.daemon.engine.engine import LLMEngine
from kvpilot.daemon.engine.request import Request


def request_of(engine: LLMEngine, request_id: str) -> Request | None:
    """The request `request_id` (its group's first sequence) while the engine holds it, else None: finished,
    aborted or never added."""
    seqs = engine._groups.get(request_id)
    return seqs[0] if seqs else None
