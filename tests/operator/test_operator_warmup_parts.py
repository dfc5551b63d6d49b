"""PrefixCacheWarmup without a cluster: the warm verdict, the pins, the prompts (inline and a ConfigMap's, with
their bounds), the status and outcome, and the warm-up fan-out against real aiohttp stand-ins on loopback
(standin.py with a block size: full blocks cached, ranks, pins, a pod that forgets, one without usage
details)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time

import pytest
import yaml
from standin import Standin
from test_operator_fanout import serving

from kvpilot.fanout import PodResult, Target, Verified, warm_prompts
from kvpilot.fanout.results import NOT_WARM, STARTING, Outcome, WarmDetail
from kvpilot.fanout.warmup import (
    UNNAMED_BLOCK,
    WarmPrompt,
    WarmSettings,
    expected_hit,
    pin_result,
    prompt_verdict,
    run_warmup,
)
from kvpilot.operator.specs import WarmupSpec
from kvpilot.operator.warmups import prompts
from kvpilot.operator.warmups.status import outcome, pod_entry, pod_status, warm_condition
from kvpilot.protocol.pins import PinResult
from support import ROOT
from support.procs import free_port

LONG = "You are a careful assistant for the fleet. " * 12  # 96 words: 6 blocks of 16
CHAT = WarmPrompt(messages=(("system", LONG), ("user", "Hello there")))
TEXT = WarmPrompt(text="Summarize the following report. " + LONG)


# ---- the verdict ---------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("tokens", "block", "hit"),
    [(96, 16, 80), (97, 16, 96), (100, 16, 96), (16, 16, 0), (17, 16, 16), (1, 1, 0), (300, 128, 256)],
)
def test_a_warm_pod_serves_the_full_blocks_short_of_the_last_token(tokens: int, block: int, hit: int) -> None:
    assert expected_hit(tokens, block) == hit


def test_prompt_verdicts() -> None:
    assert prompt_verdict(96, 100, 16) == (Verified.WARM, "")
    assert prompt_verdict(100, 100, 16)[0] == Verified.WARM
    v, why = prompt_verdict(80, 100, 16)  # one full block missing
    assert v == Verified.COLD and "80 of 100 tokens cached, 96 expected" in why
    assert prompt_verdict(0, 100, 16)[0] == Verified.COLD
    v, why = prompt_verdict(0, 10, 16)  # nothing it could hold: no claim either way
    assert v == Verified.UNKNOWN and "shorter than one block" in why
    assert prompt_verdict(None, 100, 16) == (Verified.UNKNOWN, "no cached-token count")


def test_pins_are_summed_and_the_first_reason_kept() -> None:
    assert pin_result([{"pinned": True, "blocks": 3}, {"pinned": True, "blocks": 2}]) == PinResult(True, 5)
    assert pin_result([{"pinned": True, "blocks": 3}, {"pinned": False, "blocks": 0, "reason": "cap"}]) == (
        PinResult(False, 3, "cap")
    )
    assert pin_result([None]) == PinResult(False, 0, "not reported (a kvpilot without pinned prefixes)")
    # a pod's word: a count out of range is not added, a long reason is cut and redacted
    odd = pin_result([{"pinned": False, "blocks": -4, "reason": "Bearer abcdefghijklmnop " + "x" * 300}])
    assert (
        odd.blocks == 0
        and odd.reason is not None
        and len(odd.reason) <= 64
        and "abcdefghij" not in odd.reason
    )


# ---- the prompts ---------------------------------------------------------------------------------------
def test_prompts_from_json_and_yaml() -> None:
    items = [{"messages": [{"role": "system", "content": "be brief"}]}, {"prompt": "Once upon a time"}]
    assert (
        warm_prompts.parse(json.dumps(items))
        == warm_prompts.parse(yaml.safe_dump(items))
        == (
            WarmPrompt(messages=(("system", "be brief"),)),
            WarmPrompt(text="Once upon a time"),
        )
    )


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("{}", "a list of prompts is needed, not dict"),
        ("[]", "between 1 and 64 prompts"),
        (json.dumps([{"prompt": "x"}] * 65), "between 1 and 64 prompts"),
        (
            "[{prompt: x, messages: [{role: user, content: y}]}]",
            "prompt 0: exactly one of messages and prompt",
        ),
        ("[{prompt: ok}, {}]", "prompt 1: exactly one of messages and prompt"),
        ("[{prompt: ok}, {text: nope}]", "prompt 1: an object with messages"),
        ("[{messages: [{role: robot, content: hi}]}]", "prompt 0: messages.0.role"),
        ("[{messages: [{role: user}]}]", "prompt 0: messages.0.content"),
        ("[{messages: []}]", "prompt 0: messages must hold 1 to 64"),
        ("[{prompt: ''}]", "prompt 0: prompt must have 1 to 65536 characters"),
        ("[{prompt: [unclosed", "neither JSON nor YAML"),
        # a few bytes of aliases stand for an exponential tree: refused before anything walks it
        ("- &a {prompt: x}\n- *a\n", "aliases"),
        (json.dumps([{"prompt": "x" * 1000}] * 300), "prompts are read from at most 262144 bytes"),
    ],
)
def test_a_bad_prompt_list_is_refused_with_a_reason(text: str, why: str) -> None:
    with pytest.raises(ValueError, match=None) as e:
        warm_prompts.parse(text)
    assert why in str(e.value), e.value


def test_inline_prompts_and_the_bounds_are_the_crds() -> None:
    spec = WarmupSpec.parse({"targetRef": {"name": "llm"}, "prompts": [{"prompt": "hi"}]})
    assert prompts.inline(spec.prompts or []) == (WarmPrompt(text="hi"),)
    assert (spec.mode, spec.pin, spec.timeout_seconds, spec.engine) == ("Once", False, 300, "kvpilot")
    crd = yaml.safe_load((ROOT / "crds" / "prefixcachewarmup.yaml").read_text())
    props = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]
    item = props["prompts"]["items"]["properties"]
    assert props["prompts"]["maxItems"] == warm_prompts.MAX_PROMPTS
    assert item["messages"]["maxItems"] == warm_prompts.MAX_MESSAGES
    assert item["prompt"]["maxLength"] == item["messages"]["items"]["properties"]["content"]["maxLength"]
    assert item["prompt"]["maxLength"] == warm_prompts.MAX_PROMPT_CHARS
    assert props["mode"]["enum"] == ["Once", "Continuous"]  # WarmupSpec.mode's Literal, both served
    with pytest.raises(ValueError):
        WarmPrompt()


# ---- status and outcome --------------------------------------------------------------------------------
def _res(name: str, result: Outcome, verified: Verified | None = None, reason: str = "") -> PodResult:
    r = PodResult(name, "node-1", "10.0.0.1", result=result, attempts=4, verified=verified, reason=reason)
    r.warm = WarmDetail(2, 1, warm_prompts=2 if verified == Verified.WARM else 0, block_size=16)
    return r


def test_outcome_and_the_warm_condition() -> None:
    warm = [_res("a", Outcome.SUCCEEDED, Verified.WARM), _res("b", Outcome.SUCCEEDED, Verified.WARM)]
    assert outcome(warm)[:2] == ("Succeeded", "AllPodsWarmed")
    assert warm_condition(warm)[:2] == ("True", "AllWarm")
    assert pod_status(warm)["warm"] == "2/2"
    cold = [warm[0], _res("b", Outcome.FAILED, Verified.COLD, NOT_WARM)]
    assert outcome(cold)[:2] == ("Failed", NOT_WARM)
    status, reason, message = warm_condition(cold)
    assert (status, reason) == ("False", NOT_WARM) and "1/2 pods not warm: b" in message
    broken = [warm[0], _res("b", Outcome.FAILED)]
    assert outcome(broken)[:2] == ("Failed", "PodsFailed") and warm_condition(broken)[0] == "False"
    unsure = [warm[0], _res("b", Outcome.SUCCEEDED, Verified.UNKNOWN)]
    assert outcome(unsure)[:2] == ("Succeeded", "AllPodsWarmed")
    assert warm_condition(unsure)[:2] == ("Unknown", "NotVerified")
    skipped = [_res("a", Outcome.SKIPPED)]
    assert outcome(skipped)[:2] == ("Failed", "NoTargets")
    assert outcome(skipped, allow_no_targets=True)[:2] == ("Succeeded", "NoTargets")
    assert warm_condition(skipped)[:2] == ("Unknown", "NothingWarmed")
    assert pod_status(cold)["pods"][0]["name"] == "b"  # not Succeeded first
    # a pod of the fleet left out cold (still starting at the deadline, or created meanwhile): not Warm
    loading = _res("c", Outcome.SKIPPED)
    loading.reason = STARTING
    status, reason, message = warm_condition([*warm, loading])
    assert (status, reason) == ("False", "PodsNotWarmed") and "c" in message, message
    assert warm_condition(warm, newcomers=["d"])[:2] == ("False", "PodsNotWarmed")
    assert "created during the warm-up: not warmed" in outcome(warm, newcomers=["d"])[2]


# ---- the fan-out against stand-ins ---------------------------------------------------------------------
def warm(standins: list[Standin], sends: tuple[WarmPrompt, ...] = (CHAT, TEXT), **kw) -> list[PodResult]:
    port = free_port()
    settings = dataclasses.replace(WarmSettings(prompts=sends), port=port, timeout_s=20.0, **kw)

    async def go() -> list[PodResult]:
        async with serving(standins, port) as targets:
            return await run_warmup(targets, settings, deadline=time.monotonic() + settings.timeout_s)

    return asyncio.run(go())


def test_every_prompt_to_every_pod_and_rank_then_verified_warm() -> None:
    s = [Standin(block_size=16), Standin(block_size=16, ranks=2)]
    records = warm(s)
    assert [(r.result, r.verified) for r in records] == [("Succeeded", "warm")] * 2, records
    # fill then check: 2 prompts x 2 sends a rank
    assert s[0].completions == 4 and s[0].rank_headers == [None] * 4
    assert s[1].completions == 8 and s[1].rank_headers == ["0", "0", "1", "1", "0", "0", "1", "1"]
    one = pod_entry(records[1])
    assert (one["promptsWarm"], one["ranks"], one["blockSize"]) == (2, 2, 16), one
    assert 0 < one["cachedTokens"] < one["promptTokens"]
    assert "pin" not in one and "2 prompts held on all 2 ranks" in one["verification"]
    assert s[0].pinned == 0


def test_a_pod_that_holds_nothing_is_cold_and_one_without_counts_unknown() -> None:
    s = [Standin(block_size=16, forget=True), Standin(block_size=16, no_details=True)]
    cold, unknown = warm(s)
    assert (cold.result, cold.verified, cold.reason) == ("Failed", "cold", NOT_WARM)
    assert "0 of" in cold.verify_message and "96 expected" in cold.verify_message, cold.verify_message
    assert (unknown.result, unknown.verified) == ("Succeeded", "unknown")
    assert "prompt_tokens_details" in unknown.verify_message


def test_pins_go_to_kvpilot_pods_and_their_replies_are_summed() -> None:
    s = [Standin(block_size=16, pins=True), Standin(block_size=16)]
    pinned, disabled = warm(s, pin=True)
    assert s[0].pinned == 2 and pinned.warm is not None and pinned.warm.pin == PinResult(True, 12)
    assert disabled.warm is not None and disabled.warm.pin == PinResult(False, 0, "disabled")
    assert pod_entry(disabled)["pin"] == {"pinned": False, "blocks": 0, "reason": "disabled"}
    assert pinned.verified == disabled.verified == "warm"  # the check sends carry no pin
    # vLLM pods take no pin: none is sent, none reported, and blocks are taken as 128 tokens
    vllm = [Standin(engine="vllm", block_size=16)]
    (r,) = warm(vllm, (WarmPrompt(text=LONG * 2),), pin=True, engine="vllm")
    assert vllm[0].pinned == 0 and r.warm is not None and r.warm.pin is None
    assert r.warm.block_size is None and r.verified == "warm" and f"{UNNAMED_BLOCK}" in r.verify_message


def answering(standin: Standin, statuses: dict[int, int]) -> Standin:
    """The stand-in, its n-th completion request (1-based) answered with statuses[n] instead."""
    from aiohttp import web

    seen = {"n": 0}
    real = standin.completion

    async def completion(request: web.Request) -> web.Response:
        seen["n"] += 1
        if (status := statuses.get(seen["n"])) is not None:
            return web.json_response({"error": {"message": f"said {status}"}}, status=status)
        return await real(request)

    standin.completion = completion  # type: ignore[method-assign]
    return standin


def test_transient_failures_are_retried_and_a_refusal_fails_at_once() -> None:
    flaky = answering(Standin(block_size=16), {2: 503})
    refusing = answering(Standin(block_size=16), {3: 400})
    ok, denied = warm([flaky, refusing])
    assert (ok.result, ok.verified) == ("Succeeded", "warm") and flaky.completions == 4, ok
    assert (denied.result, denied.verified, denied.http_status) == ("Failed", None, 400), denied
    assert "POST /v1/chat/completions: HTTP 400: said 400" in denied.message
    assert refusing.completions == 2  # the refused send was not retried, and nothing after it was sent


def info_failing(standin: Standin, times: int) -> Standin:
    """The stand-in, its first `times` GET /prefix_cache answered 503."""
    from aiohttp import web

    seen = {"n": 0}
    real = standin.stats

    async def stats(request: web.Request) -> web.Response:
        seen["n"] += 1
        if seen["n"] <= times:
            return web.json_response({"error": {"message": "busy"}}, status=503)
        return await real(request)

    standin.stats = stats  # type: ignore[method-assign]
    return standin


def test_a_pods_info_is_asked_again_and_without_it_no_pod_is_called_warm() -> None:
    """Its ranks and block size decide what is sent and how it is judged: a 503 is asked again; a pod whose
    info never comes cannot be called warm (a rank never sent to may be cold)."""
    once = info_failing(Standin(block_size=16, ranks=2), 1)
    never = info_failing(Standin(block_size=16, ranks=2), 1000)
    ok, blind = warm([once, never], retries_per_pod=2, backoff_base_s=0.01)
    assert (ok.result, ok.verified) == ("Succeeded", "warm") and once.completions == 8, ok
    assert (blind.result, blind.verified) == ("Succeeded", "unknown"), blind
    assert "its info could not be read" in blind.verify_message, blind.verify_message


def test_a_silent_pod_fails_by_the_deadline_and_a_bad_token_is_never_sent() -> None:
    port = free_port()
    settings = WarmSettings(prompts=(TEXT,), port=port, timeout_s=1.0, request_timeout_s=0.5)
    # 127.0.7.9:port has no listener: every call is refused, retried, then Failed within the deadline
    t0 = time.monotonic()
    (r,) = asyncio.run(run_warmup([Target("gone", "127.0.7.9")], settings))
    assert r.result == "Failed" and time.monotonic() - t0 < 5
    assert "not warmed within timeoutSeconds" in r.message or "gave up" in r.message, r.message
    bad = dataclasses.replace(settings, token="line\nbreak")
    (r,) = asyncio.run(run_warmup([Target("p", "127.0.7.9")], bad))
    assert r.result == "Failed" and "not a valid HTTP header value" in r.message
