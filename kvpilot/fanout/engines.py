"""How each engine's reset endpoint is called and how its reply is judged.

kvpilot: POST /reset_prefix_cache, JSON {"success": true, "epoch", "evicted_blocks", "ranks", ...}
         (docs/server.md, "POST /reset_prefix_cache").
vLLM:    POST /reset_prefix_cache?reset_running_requests=..; success is read from the body when there is one
         (a 200 with "success": false is a failure); 404 when the server runs without VLLM_SERVER_DEV_MODE=1.
SGLang:  POST /flush_cache; 200 when flushed, 400 while requests are pending (busy: retried until the deadline).
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass
from typing import Any

from kvpilot.fanout.redact import reported
from kvpilot.fanout.results import RankResult


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


class Engine:
    name = "base"
    method = "POST"

    def path(self, reset_running_requests: bool) -> str:
        raise NotImplementedError

    def judge(self, status: int, text: str, token: str | None = None) -> Judgement:
        """The verdict on a reply (`text`: its first bytes, as much as the caller read); `token`, the one sent,
        is redacted from anything reported."""
        raise NotImplementedError

    def common(self, status: int, text: str, token: str | None) -> Judgement | None:
        if status in (404, 501):
            return Judgement(Verdict.NOT_SUPPORTED, error_message(status, text, token))
        if status >= 500 or status in (408, 429):
            return Judgement(Verdict.TRANSIENT, error_message(status, text, token))
        if status >= 400:
            return Judgement(Verdict.FAILED, error_message(status, text, token))
        return None


class KvpilotEngine(Engine):
    name = "kvpilot"

    def path(self, reset_running_requests: bool) -> str:
        return "/reset_prefix_cache" + ("?reset_running_requests=true" if reset_running_requests else "")

    def judge(self, status: int, text: str, token: str | None = None) -> Judgement:
        if (j := self.common(status, text, token)) is not None:
            return j
        body = _body_json(text)
        if not isinstance(body, dict) or body.get("success") is not True:
            what = "not JSON" if body is None else "without success: true"
            return Judgement(Verdict.FAILED, f"HTTP {status}: a reply {what} (not a kvpilot reset reply)")
        return Judgement(
            Verdict.SUCCEEDED,
            "",
            epoch=_int_or_none(body.get("epoch")),
            evicted_blocks=_int_or_none(body.get("evicted_blocks")),
            ranks=_ranks(body),
        )


class VllmEngine(Engine):
    name = "vllm"

    def path(self, reset_running_requests: bool) -> str:
        return "/reset_prefix_cache" + ("?reset_running_requests=true" if reset_running_requests else "")

    def judge(self, status: int, text: str, token: str | None = None) -> Judgement:
        if status == 404:
            return Judgement(
                Verdict.NOT_SUPPORTED,
                "HTTP 404: /reset_prefix_cache is not exposed (vLLM serves it only with VLLM_SERVER_DEV_MODE=1)",
            )
        if (j := self.common(status, text, token)) is not None:
            return j
        body = _body_json(text)
        # Older vLLM replies 200 with an empty body; newer ones may carry {"success": bool}. Either way a
        # body that says it failed is a failure, whatever the status code.
        if isinstance(body, dict) and body.get("success") is False:
            return Judgement(Verdict.FAILED, f"HTTP {status} with success: false (blocks still held)")
        return Judgement(Verdict.SUCCEEDED, "vLLM reported success (it answers for rank 0 only)")


class SglangEngine(Engine):
    name = "sglang"

    def path(self, reset_running_requests: bool) -> str:
        # SGLang has no equivalent of reset_running_requests: it refuses to flush while requests run.
        return "/flush_cache"

    def judge(self, status: int, text: str, token: str | None = None) -> Judgement:
        if status == 400:
            return Judgement(Verdict.BUSY, "HTTP 400: not flushed while requests run or wait")
        if (j := self.common(status, text, token)) is not None:
            return j
        return Judgement(Verdict.SUCCEEDED, "SGLang reported the cache flushed")


ENGINES: dict[str, Engine] = {e.name: e for e in (KvpilotEngine(), VllmEngine(), SglangEngine())}


def engine_for(name: str) -> Engine:
    try:
        return ENGINES[name]
    except KeyError:
        raise ValueError(f"unknown engine {name!r}; known: {', '.join(ENGINES)}") from None
