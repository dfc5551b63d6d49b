"""Whether a request may run here at all: what the engine refuses before it queues anything, and why, in
terms the server turns into OpenAI's 400s and 503s."""

from __future__ import annotations

from kvpilot.daemon.engine.request import SamplingParams
from kvpilot.daemon.engine.weights.lora import LoRAAdapter, LoRAError, LoRARegistry


class RequestRejected(ValueError):
    """The request can never run here (too long for the context or the KV pool, duplicate id).
    `param` names the offending input and `code` the reason, for the server's error reply."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.param = param
        self.code = code


class QueueFull(RuntimeError):
    """`max_queued_requests` requests are already waiting: try again later (the server's 503)."""


def check_fits(prompt: list[int], params: SamplingParams, max_model_len: int, vocab_size: int) -> None:
    """The one context-length check: the prompt, and the prompt plus an explicit max_tokens; and every
    token id one of the model's."""
    if not prompt:
        raise RequestRejected("the prompt is empty", "prompt")
    n, limit = len(prompt), max_model_len
    if n >= limit + (params.max_tokens == 0):
        raise RequestRejected(
            f"This model's maximum context length is {limit} tokens; the prompt has {n} tokens "
            "(at least one token must be left for the completion)",
            "prompt",
            "context_length_exceeded",
        )
    if n + params.max_tokens > limit:
        raise RequestRejected(
            f"This model's maximum context length is {limit} tokens; you requested "
            f"{n + params.max_tokens} tokens ({n} in the prompt, {params.max_tokens} for the completion)",
            "max_tokens",
            "context_length_exceeded",
        )
    if any(type(t) is not int or not 0 <= t < vocab_size for t in prompt):
        raise RequestRejected(f"prompt token ids must be integers in [0, {vocab_size})", "prompt")


def adapter_for(loras: LoRARegistry, name: str) -> LoRAAdapter:
    """The adapter a request names (its weights read again if they were let go)."""
    try:
        lora = loras.get(name)
    except LoRAError as exc:
        raise RequestRejected(str(exc), "model", "invalid_lora_adapter") from None
    if lora is None:
        raise RequestRejected(f"no LoRA adapter {name!r} is loaded", "model", "model_not_found")
    return lora


def check_version(pinned: str | None, served: str) -> None:
    """A request that pins a weight version runs only on it."""
    if pinned is not None and pinned != served:
        raise RequestRejected(
            f"weight_version {pinned!r} is not served here: this server has {served!r}",
            "weight_version",
            "weight_version_mismatch",
        )
