"""Proof that a reset left a pod cold: a canary prompt unique to this reset and pod, sent before the reset
and after it, whose `usage.prompt_tokens_details.cached_tokens` says what the cache still held.

Before the reset the canary goes twice to each data-parallel rank: the first fills its blocks, the second
must be served from them. A second send with no hit means this probe cannot see the cache (prefix caching
off, or a vLLM without `--enable-prompt-tokens-details`): the verdict is `unknown`, never a false `cold`.
After the pod said its reset succeeded the canary goes once more: no cached token is `cold`; any is
`warm`, and the tier that answered is the one the reset missed (vLLM's offload tier without
reset_external, vLLM 57727; SGLang's HiCache storage, SGLang 9750).

The canary is long enough to fill several KV blocks of any engine (vLLM's CPU block is 128 tokens),
asks for one token, and carries its own `cache_salt` where the engine has one, so it shares no block with
any user's prompt and no user's cache is touched. What it costs is in docs/fanout.md ("Verification").
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

COLD, WARM, UNKNOWN = "cold", "warm", "unknown"
# Common English words, one token each (with their leading space) in the BPE vocabularies of the usual
# model families, so the canary's length in tokens hardly depends on the model: 300 words fill two vLLM
# CPU blocks (128 tokens) and stay under a 512-token context.
CANARY_WORDS = 300
_VOCABULARY = (
    "time year people way day man thing woman life child world school state family student group country "
    "problem hand part place case week company system program question work government number night point "
    "home water room mother area money story fact month lot right study book eye job word business issue "
    "side kind head house service friend father power hour game line end member law car city name team"
).split()
DP_RANK_HEADER = "X-data-parallel-rank"  # vLLM's, which kvpilot's daemon reads too
SALTED_ENGINES = ("kvpilot", "vllm")  # SGLang's completions take no cache_salt

# ask(method, path, json body or None, extra header lines) -> (HTTP status or 0, reply text); the caller
# bounds its time and bytes and turns connection errors into status 0 with the reason as text.
Ask = Callable[[str, str, dict[str, Any] | None, tuple[str, ...]], Awaitable[tuple[int, str]]]


@dataclass(frozen=True, slots=True)
class Canary:
    model: str
    prompt: str
    salt: str | None
    ranks: int

    def body(self) -> dict[str, Any]:
        body: dict[str, Any] = {"model": self.model, "prompt": self.prompt, "max_tokens": 1, "temperature": 0}
        if self.salt is not None:
            body["cache_salt"] = self.salt
        return body

    def headers(self, rank: int) -> tuple[str, ...]:
        return (f"{DP_RANK_HEADER}: {rank}",) if self.ranks > 1 else ()


@dataclass(frozen=True, slots=True)
class Verification:
    verdict: str  # cold, warm or unknown
    message: str = ""
    canary_tokens: int = 0  # prompt tokens of one canary, as the pod counted them


def canary_prompt(run_id: str, pod: str) -> str:
    """A prompt no one else sends: words drawn by a hash of this reset's id and the pod's name."""
    stream = b"".join(
        hashlib.sha256(f"{run_id}/{pod}/{i}".encode()).digest() for i in range(CANARY_WORDS // 32 + 1)
    )
    words = (_VOCABULARY[b % len(_VOCABULARY)] for b in stream[:CANARY_WORDS])
    return "kvpilot verification canary: " + " ".join(words)


def _usage(status: int, text: str) -> tuple[int | None, int | None, str]:
    """(cached_tokens, prompt_tokens, why not) of a completion reply."""
    if status != 200:
        return None, None, f"the canary got HTTP {status}" if status else f"the canary got no reply: {text}"
    try:
        usage = json.loads(text).get("usage") or {}
    except (ValueError, AttributeError):
        return None, None, "the canary's reply is not a completion"
    prompt = usage.get("prompt_tokens") if isinstance(usage.get("prompt_tokens"), int) else None
    details = usage.get("prompt_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    if not isinstance(cached, int) or isinstance(cached, bool):
        why = "the pod reports no usage.prompt_tokens_details.cached_tokens"
        return None, prompt, why + " (vLLM: start it with --enable-prompt-tokens-details)"
    return cached, prompt, ""


async def _model(ask: Ask) -> str | None:
    status, text = await ask("GET", "/v1/models", None, ())
    try:
        data = json.loads(text)["data"] if status == 200 else None
        model = data[0]["id"] if isinstance(data, list) and data else None
    except (ValueError, KeyError, TypeError, IndexError):
        return None
    return model if isinstance(model, str) and 0 < len(model) <= 512 else None


async def prepare(ask: Ask, engine: str, ranks: int, run_id: str, pod: str) -> Canary | Verification:
    """Warm the canary on every rank and check the pod shows its hit; the canary, or an `unknown` verdict
    that says why this pod cannot be verified."""
    model = await _model(ask)
    if model is None:
        return Verification(UNKNOWN, "GET /v1/models named no model for the canary")
    salt = f"kvpilot-canary-{run_id}" if engine in SALTED_ENGINES else None
    canary = Canary(model, canary_prompt(run_id, pod), salt, ranks)
    for rank in range(ranks):
        for send in ("fill", "hit"):
            status, text = await ask("POST", "/v1/completions", canary.body(), canary.headers(rank))
            cached, prompt, why = _usage(status, text)
            if cached is None:
                return Verification(UNKNOWN, why)
            if send == "hit" and cached == 0:
                where = f" on rank {rank}" if ranks > 1 else ""
                return Verification(
                    UNKNOWN,
                    f"the canary was not served from cache even before the reset{where} "
                    f"(prefix caching off, or {prompt} tokens do not fill a block)",
                )
    return canary


async def check(ask: Ask, canary: Canary, cleared: tuple[str, ...]) -> Verification:
    """After a successful reset: the canary once more on every rank; cold when nothing was cached."""
    tokens = 0
    for rank in range(canary.ranks):
        status, text = await ask("POST", "/v1/completions", canary.body(), canary.headers(rank))
        cached, prompt, why = _usage(status, text)
        if cached is None:
            return Verification(UNKNOWN, why)
        tokens = prompt or tokens
        if cached > 0:
            where = f"rank {rank}" if canary.ranks > 1 else "the pod"
            tiers = ", ".join(cleared) or "none named"
            return Verification(
                WARM,
                f"{where} served {cached} of {prompt} canary tokens from cache after its reset said success "
                f"(tiers cleared: {tiers}; a tier it kept still serves old blocks)",
                tokens,
            )
    return Verification(
        COLD, f"the canary ({tokens} tokens) found nothing cached on {canary.ranks} rank(s)", tokens
    )
