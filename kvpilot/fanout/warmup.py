"""Warm the prefix caches of a list of targets: each prompt to every pod and every data-parallel rank, then
proof that each pod holds them (a PrefixCacheWarmup's calls; the operator maps the results to its status).

Per pod, in the fan-out's sliding window (`caller.run_window`: deadline, pod checks, shutdown grace):
1. the model its `GET /v1/models` names first, then its info (kvpilot `GET /prefix_cache`: ranks and block
   size; SGLang `GET /server_info`: page size);
2. fill: every prompt once on each rank (`X-data-parallel-rank`, as verify.py sends a canary), `max_tokens`
   1, temperature 0; chats to /v1/chat/completions, prompts to /v1/completions; with `pin`, kvpilot pods get
   `pin_prefix: true` and their replies' `pin_prefix` objects are summed (vLLM and SGLang pods take no pin);
3. check: every prompt again on each rank, after all were filled, so what is judged is what the cache holds
   at the end (a later prompt may have evicted an earlier one from a small cache).

The verdict on one prompt (`prompt_verdict`): warm when the check send served at least its full blocks from
cache, `(prompt_tokens - 1) // block * block` tokens (an engine recomputes a prompt's last token, so a prompt
of exactly N blocks is served N - 1 of them); cold when fewer; unknown when the reply has no cached-token
count or the prompt is shorter than that one block plus a token (nothing it could hold). The pod is warm
when every prompt is warm on every rank, cold when one is cold, else unknown. The block size is the pod's
own where it names one; vLLM names none over HTTP, so its pods are judged with UNNAMED_BLOCK (docs/warmup.md
says why that and not 16).

Calls are retried by the reset's loop (`caller.call_until_final`): no reply, 5xx, 408, 429 up to
`retries_per_pod` times with backoff (a pod still starting is waited for, not counted); any other status fails
the pod at once. A pod's reply is read up to
MAX_REPLY_BYTES (http1.py) and only its counts, its pin object's fields and redacted error messages are kept.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvpilot.engines import KVPILOT
from kvpilot.fanout import verify
from kvpilot.fanout.backoff import backoff_delay
from kvpilot.fanout.caller import (
    Checkpoint,
    Judge,
    OnCall,
    Pod,
    PodGone,
    PodStarting,
    call_until_final,
    decide,
    ignore_call,
    run_window,
)
from kvpilot.fanout.engines import Engine, Judgement, Verdict, engine_for, error_message
from kvpilot.fanout.redact import reported
from kvpilot.fanout.results import (
    NOT_WARM,
    Outcome,
    PodResult,
    Verified,
    WarmDetail,
    initial_results,
)
from kvpilot.fanout.targets import CallSettings, Target
from kvpilot.protocol import DP_RANK_HEADER
from kvpilot.protocol.pins import PinResult

# vLLM names no block size over HTTP: its CPU backend's default (128 tokens) is the largest it uses, so a
# prompt is called warm there when all but its last 128 tokens were served from cache (docs/warmup.md).
UNNAMED_BLOCK = 128
MAX_REASON = 64  # characters of a pod's pin reason that are reported


@dataclass(frozen=True, slots=True)
class WarmPrompt:
    """One prompt: a chat (`messages`, (role, content) pairs) or a plain `text`; exactly one of them."""

    messages: tuple[tuple[str, str], ...] | None = None
    text: str | None = None

    def __post_init__(self) -> None:
        if (self.messages is None) == (self.text is None):
            raise ValueError("a warm-up prompt is either messages or a prompt text, not both nor neither")

    @property
    def path(self) -> str:
        return "/v1/chat/completions" if self.messages is not None else "/v1/completions"

    def body(self, model: str, pin: bool) -> dict[str, Any]:
        body: dict[str, Any] = {"model": model, "max_tokens": 1, "temperature": 0}
        if self.messages is not None:
            body["messages"] = [{"role": role, "content": content} for role, content in self.messages]
        else:
            body["prompt"] = self.text
        if pin:
            body["pin_prefix"] = True
        return body


@dataclass(frozen=True, slots=True)
class WarmSettings(CallSettings):
    """A warm-up's calls: the prompts, the engine the pods run, and whether kvpilot pods pin them."""

    engine: str = "kvpilot"
    prompts: tuple[WarmPrompt, ...] = ()
    pin: bool = False


def expected_hit(prompt_tokens: int, block: int) -> int:
    """Tokens a pod that holds a prompt serves from cache on it: its full blocks, short of its last token."""
    return max(0, (prompt_tokens - 1) // block * block)


def prompt_verdict(cached: int | None, prompt_tokens: int | None, block: int) -> tuple[Verified, str]:
    """The verdict on one prompt's check send, and a word on it when it is not warm."""
    if cached is None or prompt_tokens is None:
        return Verified.UNKNOWN, "no cached-token count"
    need = expected_hit(prompt_tokens, block)
    if need == 0:
        return Verified.UNKNOWN, f"{prompt_tokens} tokens: shorter than one block of {block} and a token"
    if cached >= need:
        return Verified.WARM, ""
    return Verified.COLD, f"{cached} of {prompt_tokens} tokens cached, {need} expected (blocks of {block})"


def pin_result(replies: Sequence[dict[str, Any] | None]) -> PinResult:
    """The pins of a pod's fill replies (each its `pin_prefix` object, None when it had none), summed."""
    pinned, blocks, reason = True, 0, None
    for pin in replies:
        if pin is None:
            pinned, reason = False, reason or "not reported (a kvpilot without pinned prefixes)"
            continue
        count = pin.get("blocks")
        if isinstance(count, int) and not isinstance(count, bool) and 0 <= count <= verify.MAX_TOKENS:
            blocks += count
        if pin.get("pinned") is not True:
            pinned = False
            why = pin.get("reason")
            reason = reason or (reported(why)[:MAX_REASON] if isinstance(why, str) and why else "not pinned")
    return PinResult(pinned and bool(replies), blocks, reason)


def _pin_object(text: str) -> dict[str, Any] | None:
    try:
        reply = json.loads(text)
    except ValueError:
        return None
    pin = reply.get("pin_prefix") if isinstance(reply, dict) else None
    return pin if isinstance(pin, dict) else None


def _judge(token: str | None) -> Judge:
    """A warm-up call's verdict: a 200 is an answer; 5xx, 408, 429 transient (retried); any other status is
    final (404 and 501 too: an engine without the route will not grow one before the deadline)."""

    def judge(status: int, text: str) -> Judgement:
        if status == 200:
            return Judgement(Verdict.SUCCEEDED)
        message = error_message(status, text, token)
        if status >= 500 or status in (408, 429):
            return Judgement(Verdict.TRANSIENT, message)
        return Judgement(Verdict.FAILED, message)

    return judge


async def _call(
    pod: Pod,
    res: PodResult,
    method: str,
    path: str,
    body: dict[str, Any] | None,
    headers: tuple[str, ...],
    started: float,
    on_call: OnCall,
) -> str | None:
    """One call, retried until final (caller.call_until_final): the 200 reply's text, or None once `res`
    holds the pod's Failed result, its message naming the call. Raises caller.Gone."""
    judge = _judge(pod.settings.token)

    def named(status: int, text: str) -> Judgement:
        j = judge(status, text)
        return dataclasses.replace(j, message=f"{method} {path}: {j.message}") if j.message else j

    ep = pod.endpoint(method, path, body, headers)
    done = await call_until_final(pod, res, ep, named, started, on_call, "warmed")
    return None if done is None else done[1]


async def _warm_one(pod: Pod, res: PodResult, engine: Engine, started: float, on_call: OnCall) -> None:
    """Fill, then check, every prompt on every rank of one pod; `res` gets its result, verdict and detail."""
    settings = pod.settings
    assert isinstance(settings, WarmSettings)
    # the model first, retried as any call: once the pod answers it, its info is worth asking
    listed = await _call(pod, res, "GET", "/v1/models", None, (), started, on_call)
    if listed is None:
        return
    model = verify.model_of(200, listed)
    if model is None:
        decide(res, Outcome.FAILED, "GET /v1/models named no model to warm", started)
        return
    info, why_info = await _info(pod, engine)
    ranks = engine.ranks(info)
    named = engine.block_size(info)
    block = named or UNNAMED_BLOCK
    pin = settings.pin and engine.name == KVPILOT.name
    res.warm = detail = WarmDetail(len(settings.prompts), ranks, block_size=named)
    pins: list[dict[str, Any] | None] = []
    for rank in range(ranks):
        headers = (f"{DP_RANK_HEADER}: {rank}",) if ranks > 1 else ()
        for prompt in settings.prompts:
            text = await _call(
                pod, res, "POST", prompt.path, prompt.body(model, pin), headers, started, on_call
            )
            if text is None:
                return
            if pin:
                pins.append(_pin_object(text))
    if pin:
        detail.pin = pin_result(pins)
    verdicts: list[tuple[Verified, str]] = []
    held = [True] * len(settings.prompts)  # each prompt: warm on every rank so far
    for rank in range(ranks):
        headers = (f"{DP_RANK_HEADER}: {rank}",) if ranks > 1 else ()
        for i, prompt in enumerate(settings.prompts):
            text = await _call(
                pod, res, "POST", prompt.path, prompt.body(model, False), headers, started, on_call
            )
            if text is None:
                return
            cached, tokens, why = verify.usage_counts(200, text, f"prompt {i}")
            verdict, note = prompt_verdict(cached, tokens, block)
            detail.prompt_tokens += tokens or 0
            detail.cached_tokens += cached or 0
            held[i] = held[i] and verdict == Verified.WARM
            where = f" on rank {rank}" if ranks > 1 else ""
            verdicts.append((verdict, f"prompt {i}{where}: {why or note}"))
    detail.warm_prompts = sum(held)
    res.verified, res.verify_message = _pod_verdict(verdicts, detail, why_info, info)
    if res.verified == Verified.COLD:
        decide(res, Outcome.FAILED, res.verify_message, started)
        res.reason = NOT_WARM
    else:
        decide(res, Outcome.SUCCEEDED, "", started)


async def _info(pod: Pod, engine: Engine) -> tuple[dict[str, Any] | None, str]:
    """The pod's info (`Pod.info`), asked again like any call (a timeout, a 503) up to `retries_per_pod`
    times within the deadline: its ranks and block size decide what is sent and how it is judged."""
    if not engine.info_paths:
        return None, ""
    settings = pod.settings
    for attempt in range(settings.retries_per_pod + 1):
        info, why = await pod.info(engine)
        if not why or pod.deadline - time.monotonic() <= 0.01:
            return info, why
        if attempt < settings.retries_per_pod:
            delay = backoff_delay(attempt + 1, settings.backoff_base_s, settings.backoff_max_s)
            await asyncio.sleep(max(0.0, min(delay, pod.deadline - time.monotonic())))
    return info, why


def _pod_verdict(
    verdicts: Sequence[tuple[Verified, str]], detail: WarmDetail, why_info: str, info: dict[str, Any] | None
) -> tuple[Verified, str]:
    block = (
        f"blocks of {detail.block_size}"
        if detail.block_size
        else f"blocks taken as {UNNAMED_BLOCK} (the pod names none)"
    )
    if why_info:
        block += f"; its info: {why_info}"
    cold = [note for v, note in verdicts if v == Verified.COLD]
    if why_info and not cold:
        # without its info a pod's ranks and block size are guesses: a rank never sent to may be cold
        return (
            Verified.UNKNOWN,
            f"its info could not be read, so its ranks and blocks are not known: {why_info}",
        )
    if cold:
        off = " (its prefix caching is off)" if (info or {}).get("enable_prefix_caching") is False else ""
        return Verified.COLD, f"{len(cold)} of {len(verdicts)} prompt sends not held{off}: {cold[0]}; {block}"
    unknown = [note for v, note in verdicts if v == Verified.UNKNOWN]
    if unknown:
        return Verified.UNKNOWN, f"{len(unknown)} of {len(verdicts)} prompt sends not judged: {unknown[0]}"
    ranks = f" on all {detail.ranks} ranks" if detail.ranks > 1 else ""
    return (
        Verified.WARM,
        f"{detail.prompts} prompts held{ranks}: {detail.cached_tokens} of {detail.prompt_tokens} tokens served "
        f"from cache on their second send ({block})",
    )


async def run_warmup(
    targets: Sequence[Target],
    settings: WarmSettings,
    *,
    deadline: float | None = None,
    checkpoint: Checkpoint | None = None,
    pod_gone: PodGone | None = None,
    pod_starting: PodStarting | None = None,
    limiter: asyncio.Semaphore | None = None,
    stop: asyncio.Event | None = None,
    on_call: OnCall | None = None,
) -> list[PodResult]:
    """Warm every target; one result per target, sorted by name, all final unless `stop` was set (as
    run_fanout's). A Succeeded pod is warm or unknown (its verify_message says why); a cold one is Failed,
    reason NOT_WARM."""
    if not settings.prompts:
        raise ValueError("a warm-up needs at least one prompt")
    engine = engine_for(settings.engine)
    on_call = on_call or ignore_call

    async def job(pod: Pod, res: PodResult, started: float) -> None:
        await _warm_one(pod, res, engine, started, on_call)

    return await run_window(
        initial_results(targets),
        settings,
        job,
        deadline=deadline,
        checkpoint=checkpoint,
        pod_gone=pod_gone,
        pod_starting=pod_starting,
        limiter=limiter,
        stop=stop,
        unfinished=f"not warmed within timeoutSeconds ({settings.timeout_s:g}s)",
    )
