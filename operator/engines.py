"""How each engine's reset endpoint is called and how its reply is judged.

kvpilot: POST /reset_prefix_cache, JSON {"success": true, "epoch", "evicted_blocks", ...} (DESIGN section 2).
vLLM:    POST /reset_prefix_cache?reset_running_requests=..; success is read from the body when there is one
         (a 200 with "success": false is a failure); 404 when the server runs without VLLM_SERVER_DEV_MODE=1.
SGLang:  POST /flush_cache; 200 when flushed, 400 while requests are pending (busy: retried until the deadline).
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass
from typing import Any

MAX_RANKS = 64  # per pod in status (the CRD's maxItems): a node has at most a few dozen accelerators


class Verdict(enum.Enum):
    SUCCEEDED = "Succeeded"
    FAILED = "Failed"  # final: the pod said no (4xx) or the reply is not a success
    NOT_SUPPORTED = "NotSupported"
    TRANSIENT = "Transient"  # retried up to retriesPerPod: 5xx, 408, 429, connection errors, timeouts
    BUSY = "Busy"  # retried until the deadline without counting against retriesPerPod


@dataclass(frozen=True, slots=True)
class Judgement:
    verdict: Verdict
    message: str = ""
    epoch: int | None = None
    evicted_blocks: int | None = None
    ranks: tuple[dict[str, Any], ...] | None = None  # kvpilot: one entry per data-parallel rank


def _rank_entries(body: dict[str, Any]) -> tuple[dict[str, Any], ...] | None:
    """The reply's `ranks` as status entries (camelCase, only well-typed fields), or None without any."""
    ranks = body.get("ranks")
    if not isinstance(ranks, list):
        return None
    out = []
    for r in ranks[:MAX_RANKS]:
        if not isinstance(r, dict) or not isinstance(r.get("rank"), int):
            continue
        entry: dict[str, Any] = {"rank": r["rank"], "success": r.get("success") is True}
        for src, dst in (("epoch", "epoch"), ("evicted_blocks", "evictedBlocks")):
            if isinstance(r.get(src), int):
                entry[dst] = r[src]
        out.append(entry)
    return tuple(out)


def _body_json(text: str) -> Any:
    try:
        return json.loads(text) if text.strip() else None
    except ValueError:
        return None


def _error_message(status: int, text: str) -> str:
    body = _body_json(text)
    if isinstance(body, dict):
        err = body.get("error")
        if isinstance(err, dict) and err.get("message"):
            return f"HTTP {status}: {err['message']}"
        if isinstance(err, str):
            return f"HTTP {status}: {err}"
        if body.get("message"):
            return f"HTTP {status}: {body['message']}"
        if body.get("detail"):
            return f"HTTP {status}: {body['detail']}"
    snippet = " ".join(text.split())[:200]
    return f"HTTP {status}" + (f": {snippet}" if snippet else "")


class Engine:
    name = "base"
    method = "POST"
    # Path of a read-only stats endpoint that reports the cache epoch, or None. Used after an operator
    # restart to tell whether a call that was in flight took effect (see fanout.py).
    epoch_path: str | None = None

    def path(self, reset_running_requests: bool) -> str:
        raise NotImplementedError

    def judge(self, status: int, text: str) -> Judgement:
        raise NotImplementedError

    def common(self, status: int, text: str) -> Judgement | None:
        if status in (404, 501):
            return Judgement(Verdict.NOT_SUPPORTED, _error_message(status, text))
        if status >= 500 or status in (408, 429):
            return Judgement(Verdict.TRANSIENT, _error_message(status, text))
        if status >= 400:
            return Judgement(Verdict.FAILED, _error_message(status, text))
        return None


class KvpilotEngine(Engine):
    name = "kvpilot"
    epoch_path = "/prefix_cache"

    def path(self, reset_running_requests: bool) -> str:
        return "/reset_prefix_cache" + ("?reset_running_requests=true" if reset_running_requests else "")

    def judge(self, status: int, text: str) -> Judgement:
        if (j := self.common(status, text)) is not None:
            return j
        body = _body_json(text)
        if not isinstance(body, dict) or body.get("success") is not True:
            return Judgement(
                Verdict.FAILED, f"HTTP {status} without success: true in the reply: {text[:200]!r}"
            )
        return Judgement(
            Verdict.SUCCEEDED,
            "",
            epoch=body.get("epoch") if isinstance(body.get("epoch"), int) else None,
            evicted_blocks=body.get("evicted_blocks")
            if isinstance(body.get("evicted_blocks"), int)
            else None,
            ranks=_rank_entries(body),
        )


class VllmEngine(Engine):
    name = "vllm"

    def path(self, reset_running_requests: bool) -> str:
        return "/reset_prefix_cache" + ("?reset_running_requests=true" if reset_running_requests else "")

    def judge(self, status: int, text: str) -> Judgement:
        if status == 404:
            return Judgement(
                Verdict.NOT_SUPPORTED,
                "HTTP 404: /reset_prefix_cache is not exposed (vLLM serves it only with VLLM_SERVER_DEV_MODE=1)",
            )
        if (j := self.common(status, text)) is not None:
            return j
        body = _body_json(text)
        # Older vLLM replies 200 with an empty body; newer ones may carry {"success": bool}. Either way a
        # body that says it failed is a failure, whatever the status code.
        if isinstance(body, dict) and body.get("success") is False:
            return Judgement(Verdict.FAILED, f"HTTP {status} with success: false: {text[:200]}")
        return Judgement(Verdict.SUCCEEDED, "vLLM reported success (it answers for rank 0 only)")


class SglangEngine(Engine):
    name = "sglang"

    def path(self, reset_running_requests: bool) -> str:
        # SGLang has no equivalent of reset_running_requests: it refuses to flush while requests run.
        return "/flush_cache"

    def judge(self, status: int, text: str) -> Judgement:
        if status == 400:
            return Judgement(Verdict.BUSY, _error_message(status, text))
        if (j := self.common(status, text)) is not None:
            return j
        return Judgement(Verdict.SUCCEEDED, " ".join(text.split())[:200])


ENGINES: dict[str, Engine] = {e.name: e for e in (KvpilotEngine(), VllmEngine(), SglangEngine())}


def engine_for(name: str) -> Engine:
    try:
        return ENGINES[name]
    except KeyError:
        raise ValueError(f"unknown engine {name!r}; known: {', '.join(ENGINES)}") from None
