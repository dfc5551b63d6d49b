"""What the engine tests read of a running engine that the server never needs: a request by its id, one
request's tokens and cached-token count; and a weight update both of two engines must see."""

from __future__ import annotations

from kvpilot.daemon.engine.client import EngineRequest
from kvpilot.daemon.engine.engine import LLMEngine
from kvpilot.daemon.engine.models.llama import Weight
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


def assert_a_weight_update_reaches_both(
    engines: tuple[LLMEngine, LLMEngine], prompt: list[int], params: SamplingParams
) -> None:
    """Every layer's down_proj negated in place, as an update writes into the weights (weights/stage.py),
    then put back: the second engine, whose step keeps something derived from the weights (a compiled
    graph, packed copies), must give the first one's tokens with the new weights, and its own again after."""
    before = run_alone(engines[1], "before", prompt, params)[0]

    def down_projs(e: LLMEngine) -> list[Weight]:  # as an update reaches them, wherever they are kept
        weights = e.runner.model.weights()
        return [w for name, w in sorted(weights.items()) if name.endswith("mlp.down_proj.weight")]

    saved = [w.read().clone() for w in down_projs(engines[1])]
    for e in engines:
        down = down_projs(e)
        e.swap_weights("v2", lambda down=down: [w.write(-w.read()) for w in down])
    try:
        changed = [run_alone(e, "changed", prompt, params)[0] for e in engines]
        assert changed[0] == changed[1] != before
    finally:
        for e in engines:
            down = down_projs(e)
            e.swap_weights("v1", lambda down=down: [w.write(v) for w, v in zip(down, saved)])
    assert run_alone(engines[1], "restored", prompt, params)[0] == before
