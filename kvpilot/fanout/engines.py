"""How each engine's reset endpoint is called and how its reply is judged (what else kvpilot knows of each
engine, the paths it answers on and what it supports, is `kvpilot/engines.py`).

kvpilot: POST /reset_prefix_cache, JSON {"success": true, "epoch", "evicted_blocks", "ranks", ...}
         (docs/server.md, "POST /reset_prefix_cache").
vLLM:    POST /reset_prefix_cache?reset_external=true[&reset_running_requests=true]; success is read from the
         body when there is one (a 200 with "success": false is busy: retried until the deadline); 404 when
         the server runs without VLLM_SERVER_DEV_MODE=1 (vLLM 0.32, serve/dev/cache/api_router.py).
SGLang:  POST /flush_cache, then POST /clear_hicache_storage_backend when /get_server_info names a HiCache
         storage backend; 200 when done, 400 while requests are pending or HiCache moves data (busy: retried
         until the deadline) (SGLang 0.5.x, entrypoints/http_server.py).
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass
from typing import Any

from kvpilot.engines import KVPILOT, SGLANG, VLLM, EngineTraits, traits_of
from kvpilot.fanout.redact import reported
from kvpilot.fanout.results import RankResult
from kvpilot.fanout.targets import ResetSettings
from kvpilot.fanout.verify import CANARY_WORDS, MIN_CANARY_WORDS


class Verdict(enum.Enum):
    SUCCEEDED = "Succeeded"
    FAILED = "Failed"  # final: the pod said no (4xx) or the reply is not a success
    NOT_SUPPORTED = "NotSupported"
    TRANSIENT = "Transient"  # retried up to retries_per_pod times: 5xx, 408, 429, connection errors, timeouts
    BUSY = "Busy"  # retried until the deadline without counting against retries_per_pod


@dataclass(frozen=True, slots=True)
class Judgement:
    verdict: Verdict
    message: str = ""
    epoch: int | None = None
    evicted_blocks: int | None = None
    ranks: tuple[RankResult, ...] | None = None  # kvpilot: one entry per data-parallel rank
    # The cache tiers the call cleared, named as kvpilot names its own: pool, host, disk; external (vLLM's
    # offload tier and KV connectors), storage (SGLang's HiCache L3).
    tiers: tuple[str, ...] = ()


MAX_BLOCK_SIZE = 4096  # tokens: a block size past it is no answer


def _size(value: Any) -> int | None:
    return (
        value
        if isinstance(value, int) and not isinstance(value, bool) and 0 < value <= MAX_BLOCK_SIZE
        else None
    )


def _int_or_none(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _ranks(body: dict[str, Any]) -> tuple[RankResult, ...] | None:
    """The reply's `ranks` (entries without an integer rank left out), or None when it has none."""
    ranks = body.get("ranks")
    if not isinstance(ranks, list):
        return None
    return tuple(
        RankResult(
            rank=r["rank"],
            success=r.get("success") is True,
            epoch=_int_or_none(r.get("epoch")),
            evicted_blocks=_int_or_none(r.get("evicted_blocks")),
        )
        for r in ranks
        if isinstance(r, dict) and _int_or_none(r.get("rank")) is not None
    )


def _body_json(text: str) -> Any:
    try:
        return json.loads(text) if text.strip() else None
    except ValueError:
        return None


def error_message(status: int, text: str, token: str | None = None) -> str:
    """ "HTTP STATUS", with the pod's OpenAI error message (error.message) when it sent one, as redact says it
    may be reported. Nothing else of the body is ever reported: it may echo what the pod was sent."""
    body = _body_json(text)
    err = body.get("error") if isinstance(body, dict) else None
    message = err.get("message") if isinstance(err, dict) else None
    if isinstance(message, str) and message.strip():
        return f"HTTP {status}: {reported(message, (token,))}"
    return f"HTTP {status}"


@dataclass(frozen=True, slots=True)
class ResetCall:
    """One call of an engine's reset, and the cache tiers it clears once it succeeds (the result's `cleared`)."""

    path: str
    tiers: tuple[str, ...]
    method: str = "POST"
    body: dict[str, Any] | None = None  # a JSON body (a scoped reset's scope: a salt may be 4096 characters)


class Engine:
    traits: EngineTraits
    info_decides_calls = False  # True: the info is asked before every reset, not only to verify

    @property
    def name(self) -> str:
        return self.traits.name

    @property
    def info_paths(self) -> tuple[str, ...]:
        """Asked once per pod before its reset (`EngineTraits.info_paths`)."""
        return self.traits.info_paths

    @property
    def scoped_resets(self) -> bool:
        return self.traits.scoped_resets

    def canary_words(self, info: dict[str, Any] | None) -> int:
        """Words in a reset's verification canary (verify.py): enough for several of the engine's blocks."""
        return CANARY_WORDS

    def ranks(self, info: dict[str, Any] | None) -> int:
        """How many data-parallel ranks a canary must reach, each by vLLM's X-data-parallel-rank header;
        1: the engine picks the rank (one canary)."""
        return 1

    def block_size(self, info: dict[str, Any] | None) -> int | None:
        """Tokens per cached block as the pod's info says (a warm-up's verdict, warmup.py); None: it names none."""
        return None

    def calls(self, settings: ResetSettings, info: dict[str, Any] | None) -> list[ResetCall]:
        """The calls that reset every tier of one pod, in order; each is retried until it is final."""
        raise NotImplementedError

    def judge(self, call: ResetCall, status: int, text: str, token: str | None = None) -> Judgement:
        """The verdict on a reply to `call` (`text`: its first bytes, as much as the caller read); `token`,
        the one sent, is redacted from anything reported."""
        raise NotImplementedError

    def common(self, status: int, text: str, token: str | None) -> Judgement | None:
        if status in (404, 501):
            return Judgement(Verdict.NOT_SUPPORTED, error_message(status, text, token))
        if status >= 500 or status in (408, 429):
            return Judgement(Verdict.TRANSIENT, error_message(status, text, token))
        if status >= 400:
            return Judgement(Verdict.FAILED, error_message(status, text, token))
        return None


def _query(path: str, **flags: bool) -> str:
    on = [name for name, value in flags.items() if value]
    return path + ("?" + "&".join(f"{name}=true" for name in on) if on else "")


KVPILOT_TIERS = (
    "pool",
    "host",
    "disk",
)  # a kvpilot reply's evicted_by_tier keys (daemon/engine/kv/offload.py)


class KvpilotEngine(Engine):
    traits = KVPILOT

    def canary_words(self, info: dict[str, Any] | None) -> int:
        # Three of its blocks (--block-size, 16 tokens by default: 48 words): the canary's cost is its length.
        block = (info or {}).get("block_size")
        if not isinstance(block, int) or isinstance(block, bool) or block < 1:
            return CANARY_WORDS
        return max(MIN_CANARY_WORDS, min(3 * block, CANARY_WORDS))

    def ranks(self, info: dict[str, Any] | None) -> int:
        listed = (info or {}).get("ranks")
        return max(1, min(len(listed), 64)) if isinstance(listed, list) else 1

    def block_size(self, info: dict[str, Any] | None) -> int | None:
        return _size((info or {}).get("block_size"))  # GET /prefix_cache (--block-size)

    def calls(self, settings: ResetSettings, info: dict[str, Any] | None) -> list[ResetCall]:
        # A kvpilot reset always clears every tier (pool, host, disk): reset_external is not needed. The
        # tiers it cleared are those its reply counts in evicted_by_tier.
        path = _query("/reset_prefix_cache", reset_running_requests=settings.reset_running_requests)
        # The daemon's scoped reset (docs/server.md): the scope's blocks only; a body, as a salt may be long.
        scope = settings.scope.to_dict() if settings.scope is not None else None
        return [ResetCall(path, (), body=scope)]

    def judge(self, call: ResetCall, status: int, text: str, token: str | None = None) -> Judgement:
        if (j := self.common(status, text, token)) is not None:
            return j
        body = _body_json(text)
        if not isinstance(body, dict) or body.get("success") is not True:
            what = "not JSON" if body is None else "without success: true"
            return Judgement(Verdict.FAILED, f"HTTP {status}: a reply {what} (not a kvpilot reset reply)")
        if call.body is not None and body.get("scope") != call.body:
            # a daemon from before scoped resets ignores the scope and resets everything
            return Judgement(
                Verdict.FAILED, "the pod did not reset the scope asked (a kvpilot too old for scoped resets)"
            )
        by_tier = body.get("evicted_by_tier")
        # only the tier names a kvpilot daemon has: a pod's reply never puts its own strings in a status
        tiers = tuple(t for t in KVPILOT_TIERS if t in by_tier) if isinstance(by_tier, dict) else ("pool",)
        return Judgement(
            Verdict.SUCCEEDED,
            "",
            epoch=_int_or_none(body.get("epoch")),
            evicted_blocks=_int_or_none(body.get("evicted_blocks")),
            ranks=_ranks(body),
            tiers=tiers,
        )


class VllmEngine(Engine):
    traits = VLLM

    def calls(self, settings: ResetSettings, info: dict[str, Any] | None) -> list[ResetCall]:
        # reset_external=true also clears vLLM's CPU offload tier and its KV connectors (LMCache and
        # others); without it vLLM answers success while those keep serving the old blocks (vLLM 57727).
        path = _query(
            "/reset_prefix_cache",
            reset_running_requests=settings.reset_running_requests,
            reset_external=settings.reset_external,
        )
        return [ResetCall(path, ("pool", "external") if settings.reset_external else ("pool",))]

    def judge(self, call: ResetCall, status: int, text: str, token: str | None = None) -> Judgement:
        if status == 404:
            return Judgement(
                Verdict.NOT_SUPPORTED,
                "HTTP 404: /reset_prefix_cache is not exposed (vLLM serves it only with VLLM_SERVER_DEV_MODE=1)",
            )
        if (j := self.common(status, text, token)) is not None:
            return j
        body = _body_json(text)
        # vLLM answers 200 {"success": false} while running requests still hold blocks ("callers may
        # retry", says its docstring): busy, retried until the deadline, never a success.
        if isinstance(body, dict) and body.get("success") is False:
            return Judgement(
                Verdict.BUSY,
                f"HTTP {status} with success: false (running requests hold blocks, or a KV connector did not reset)",
            )
        return Judgement(
            Verdict.SUCCEEDED, "vLLM reported success (it answers for rank 0 only)", tiers=call.tiers
        )


class SglangEngine(Engine):
    traits = SGLANG
    info_decides_calls = True

    def block_size(self, info: dict[str, Any] | None) -> int | None:
        # GET /server_info lists the server's arguments; --page-size is 1 unless set (its radix tree caches
        # single tokens)
        if info is None:
            return None
        return _size(info.get("page_size", 1))

    def calls(self, settings: ResetSettings, info: dict[str, Any] | None) -> list[ResetCall]:
        # /flush_cache resets the radix tree, and with HiCache its host pool; the storage tier (L3) needs
        # its own call (SGLang 9750). SGLang has no equivalent of reset_running_requests: it refuses to
        # flush while requests run.
        info = info or {}
        tiers = ("pool", "host") if info.get("enable_hierarchical_cache") else ("pool",)
        calls = [ResetCall("/flush_cache", tiers)]
        if info.get("hicache_storage_backend"):
            calls.append(ResetCall("/clear_hicache_storage_backend", ("storage",)))
        return calls

    def judge(self, call: ResetCall, status: int, text: str, token: str | None = None) -> Judgement:
        if status == 400:
            # /flush_cache: requests run or wait; the storage clear: HiCache is moving data (SGLang 21413).
            return Judgement(
                Verdict.BUSY, f"HTTP 400 from {call.path}: not flushed while requests run or data moves"
            )
        if (j := self.common(status, text, token)) is not None:
            return j
        return Judgement(Verdict.SUCCEEDED, "SGLang reported the cache flushed", tiers=call.tiers)


ADAPTERS: dict[str, Engine] = {e.name: e for e in (KvpilotEngine(), VllmEngine(), SglangEngine())}


def engine_for(name: str) -> Engine:
    return ADAPTERS[traits_of(name).name]  # an unknown name is refused as traits_of words it
