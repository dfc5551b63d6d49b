"""Proof that a reset left a pod cold: a canary prompt unique to this reset and pod, sent before the reset
and after it, whose `usage.prompt_tokens_details.cached_tokens` says what the cache still held.

Before the reset the canary goes twice to each data-parallel rank: the first fills its blocks, the second
must be served from them. A second send with no hit means this probe cannot see the cache (prefix caching
off, or a vLLM without `--enable-prompt-tokens-details`): the verdict is `unknown`, never a false `cold`.
After the pod said its reset succeeded the canary goes once more, and where it still finds tokens cached, a
control prompt after it: the same template with other unique words, never sent before, so what it finds is
what any prompt shares with others (a BOS, the template: SGLang caches single tokens). The pod is `cold`
only when the canary finds no more than the control; a single stale block of the canary's own words is
`warm`, and the tier that answered is the one the reset missed (vLLM's offload tier without
reset_external, vLLM 57727; SGLang's HiCache storage, SGLang 9750).

The canary is long enough to fill several KV blocks of its engine (`Engine.canary_words`: vLLM's CPU
block is 128 tokens, a kvpilot pod's as its /prefix_cache says, 16 by default), asks for one token, and carries its own `cache_salt` where
the engine has one, so it shares no block with any user's prompt and no user's cache is touched. A scoped reset's canary runs inside the scope: under its
adapter (as the model), its salt, pinned to its weight version; a cold one proves that scope cold. What it
costs is in docs/fanout.md ("Verification").
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from kvpilot.engines import ENGINES
from kvpilot.fanout.results import Verified
from kvpilot.kv.reset_scope import TENANT_SALT_PREFIX, ResetScope
from kvpilot.protocol import DP_RANK_HEADER

# Common English words, one token each (with their leading space) in the BPE vocabularies of the usual
# model families, so the canary's length in tokens hardly depends on the model: 300 words fill two vLLM
# CPU blocks (128 tokens) and stay under a 512-token context; an engine whose blocks are smaller needs fewer
# (`fanout.engines.Engine.canary_words`).
CANARY_WORDS = 300
MIN_CANARY_WORDS = 48
_VOCABULARY = (
    "time year people way day man thing woman life child world school state family student group country "
    "problem hand part place case week company system program question work government number night point "
    "home water room mother area money story fact month lot right study book eye job word business issue "
    "side kind head house service friend father power hour game line end member law car city name team"
).split()
MAX_TOKENS = 1 << 20  # a usage count past this is no answer
MIN_HIT = 16  # tokens served from cache before the reset for the canary to show anything: one small block
# First in the canary and in its control, so both share equally whatever other prompts share with it.
TEMPLATE = "kvpilot verification canary:"

# ask(method, path, json body or None, extra header lines) -> (HTTP status or 0, reply text); the caller
# bounds its time and bytes and turns connection errors into status 0 with the reason as text.
Ask = Callable[[str, str, dict[str, Any] | None, tuple[str, ...]], Awaitable[tuple[int, str]]]


@dataclass(frozen=True, slots=True)
class Canary:
    model: str
    prompt: str
    control: str  # the control prompt: the canary's template, other words (sent only after the reset)
    salt: str | None
    ranks: int
    hit: int  # the fewest tokens any rank served from cache before the reset
    weight_version: str | None = None  # a scoped reset's: the canary runs on those weights or not at all

    def body(self, prompt: str | None = None) -> dict[str, Any]:
        """The completion request of the canary, or of `prompt` (its control) under the same scope."""
        body: dict[str, Any] = {
            "model": self.model,
            "prompt": prompt or self.prompt,
            "max_tokens": 1,
            "temperature": 0,
        }
        if self.salt is not None:
            body["cache_salt"] = self.salt
        if self.weight_version is not None:
            body["weight_version"] = self.weight_version
        return body

    def headers(self, rank: int) -> tuple[str, ...]:
        return (f"{DP_RANK_HEADER}: {rank}",) if self.ranks > 1 else ()


@dataclass(frozen=True, slots=True)
class Verification:
    verdict: Verified
    message: str = ""


def canary_prompt(run_id: str, pod: str, words: int) -> str:
    """A prompt no one else sends: the template, then `words` words drawn by a hash of this reset's id and
    the pod's name (a control's id differs), so it shares no more than the template with any other."""
    stream = b"".join(hashlib.sha256(f"{run_id}/{pod}/{i}".encode()).digest() for i in range(words // 32 + 1))
    return " ".join([TEMPLATE, *(_VOCABULARY[b % len(_VOCABULARY)] for b in stream[:words])])


def _count(value: object) -> int | None:
    return (
        value if isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_TOKENS else None
    )


def usage_counts(status: int, text: str, what: str = "the canary") -> tuple[int | None, int | None, str]:
    """(cached_tokens, prompt_tokens, why not) of a completion reply (`what` was sent: named in the why); a
    reply is the pod's word, so counts out of range (negative, more cached than sent, past MAX_TOKENS) are no
    answer. A warm-up's prompts are read by it too (warmup.py)."""
    if status != 200:
        return None, None, f"{what} got HTTP {status}" if status else f"{what} got no reply: {text}"
    try:
        reply = json.loads(text)
    except ValueError:
        reply = None
    usage = reply.get("usage") if isinstance(reply, dict) else None
    if not isinstance(usage, dict):
        return None, None, f"the reply to {what} is not a completion"
    prompt = _count(usage.get("prompt_tokens"))
    details = usage.get("prompt_tokens_details")
    raw = details.get("cached_tokens") if isinstance(details, dict) else None
    if raw is None:
        why = "the pod reports no usage.prompt_tokens_details.cached_tokens"
        return None, prompt, why + " (vLLM: start it with --enable-prompt-tokens-details)"
    cached = _count(raw)
    if cached is None or prompt is None or cached > prompt:
        return None, prompt, f"the usage counts of the reply to {what} are out of range"
    return cached, prompt, ""


def model_of(status: int, text: str) -> str | None:
    """The first model a GET /v1/models reply names (bounded: a name past 512 characters is none)."""
    try:
        data = json.loads(text)["data"] if status == 200 else None
        model = data[0]["id"] if isinstance(data, list) and data else None
    except (ValueError, KeyError, TypeError, IndexError):
        return None
    return model if isinstance(model, str) and 0 < len(model) <= 512 else None


async def served_model(ask: Ask) -> str | None:
    """The first model the pod's GET /v1/models names (what a canary asks for)."""
    return model_of(*await ask("GET", "/v1/models", None, ()))


async def prepare(
    ask: Ask,
    engine: str,
    ranks: int,
    run_id: str,
    pod: str,
    scope: ResetScope | None = None,
    words: int = CANARY_WORDS,
) -> Canary | Verification:
    """Warm the canary on every rank (inside `scope`, for a scoped reset) and check the pod shows its hit;
    the canary, or an `unknown` verdict that says why this pod cannot be verified."""
    scope = scope or ResetScope()
    model = scope.lora_name or await served_model(ask)
    if model is None:
        return Verification(Verified.UNKNOWN, "GET /v1/models named no model for the canary")
    traits = ENGINES.get(engine)
    salt = scope.cache_salt or (
        f"kvpilot-canary-{run_id}" if traits is not None and traits.cache_salt else None
    )
    if scope.tenant is not None:  # a partition of the tenant's, which a reset of it clears
        salt = f"{TENANT_SALT_PREFIX}{scope.tenant}:kvpilot-canary-{run_id}"
    prompt, control = canary_prompt(run_id, pod, words), canary_prompt(f"{run_id}/control", pod, words)
    hit = MAX_TOKENS
    for rank in range(ranks):
        headers = (f"{DP_RANK_HEADER}: {rank}",) if ranks > 1 else ()
        body = Canary(model, prompt, control, salt, ranks, 0, scope.weight_version).body()
        for send in ("fill", "hit"):
            cached, tokens, why = usage_counts(*await ask("POST", "/v1/completions", body, headers))
            if cached is None:
                return Verification(Verified.UNKNOWN, why)
            if send == "hit":
                if cached < MIN_HIT:
                    where = f" on rank {rank}" if ranks > 1 else ""
                    return Verification(
                        Verified.UNKNOWN,
                        f"the canary was not served from cache even before the reset{where} "
                        f"({cached} of {tokens} tokens: prefix caching off, or a block longer than it)",
                    )
                hit = min(hit, cached)
    return Canary(model, prompt, control, salt, ranks, hit, scope.weight_version)


async def check(ask: Ask, canary: Canary, cleared: tuple[str, ...]) -> Verification:
    """After a successful reset: the canary once more on every rank. Warm when a rank serves more of it from
    cache than of the control prompt (what any prompt shares with others: a BOS, the template, on an engine
    that caches single tokens as SGLang does); cold when none does. The control is sent only where the
    canary found something, so a cold pod costs one request per rank."""
    unknown = ""
    tokens = shared = 0
    for rank in range(canary.ranks):
        cached, prompt, why = usage_counts(
            *await ask("POST", "/v1/completions", canary.body(), canary.headers(rank))
        )
        control: int | None = 0
        if cached:
            control, _, why = usage_counts(
                *await ask("POST", "/v1/completions", canary.body(canary.control), canary.headers(rank))
            )
        if cached is None or control is None:
            unknown = unknown or why  # the other ranks are still checked: one of them may be warm
            continue
        tokens, shared = prompt or tokens, max(shared, cached)
        if cached > control:
            where = f"rank {rank}" if canary.ranks > 1 else "the pod"
            tiers = ", ".join(cleared) or "none named"
            return Verification(
                Verified.WARM,
                f"{where} served {cached} of {prompt} canary tokens from cache after its reset said success "
                f"(a control prompt {control}, the canary {canary.hit} before the reset; tiers cleared: "
                f"{tiers}; a tier it kept still serves old blocks)",
            )
    if unknown:
        return Verification(Verified.UNKNOWN, unknown)
    where = f"on all {canary.ranks} ranks" if canary.ranks > 1 else "on the rank the pod chose"
    found = f"no more cached than a control prompt ({shared})" if shared else "nothing cached"
    return Verification(Verified.COLD, f"the canary ({tokens} tokens) found {found} {where}")
