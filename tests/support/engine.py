"""What the engine tests read of a running engine that the server never needs: a request by its id, one
request's tokens and cached-token count."""

from __future__ import annotations

from kvpilot.daemon.engine.client import EngineRequest
from kvpilot.daemon.engine.engine import LLMEngine
from kvpilot.daemon.engine.request import Request, SamplingParams


def request_of(engine: LLMEngine, request_id: str) -> Request | None:
    """The request `request_id` (its group's first sequence) while the engine holds it, else None: finished,
    aborted or never added."""
    seqs = engine.groups.get(request_id)
    return seqs[0] if seqs else None


def run_alone(
    engine: LLMEngine,
    request_id: str,
    prompt: list[int],
    params: SamplingParams,
    cache_salt: str | None = None,
) -> tuple[list[int], int]:
    """Run one request to its end (others may share its steps): its tokens and its cached-token count."""
    return run_request(engine, EngineRequest(request_id, prompt, params, cache_salt))


def run_request(engine: LLMEngine, req: EngineRequest) -> tuple[list[int], int]:
    """`run_alone` of a request as the server hands it over (with what only it carries: a hold, pulled KV)."""
    engine.submit(req)
    tokens, cached = [], -1
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.request_id == req.request_id:
                tokens += o.new_token_ids
                cached = o.num_cached_tokens
    return tokens, cached
