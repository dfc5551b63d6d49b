"""One call (`run_phase`) or a short sequence of calls (`run_steps`) to every target, for a multi-step
operation such as a weight update: each phase (stage, commit, drop) runs over the targets that take part,
and the caller decides from all the replies whether the next phase may start. Unlike `run_fanout` a call is made once: a weight step is not
retried blindly (the caller knows whether a second call is safe), and the reply's JSON object (at most
MAX_REPLY_BYTES) is handed back.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from kvpilot.fanout.engines import error_message
from kvpilot.fanout.redact import MAX_REPLY_BYTES
from kvpilot.fanout.targets import CallSettings, Target, address
from kvpilot.serving.capped_read import read_capped


def _url(target: Target, settings: CallSettings) -> str:
    host, port, tls, prefix = address(target, settings)
    host = f"[{host}]" if ":" in host else host  # IPv6
    return f"{'https' if tls else 'http'}://{host}:{port}{prefix}"


@dataclass(slots=True)
class PhaseReply:
    """One target's reply to one step: ok only on a 2xx with a JSON object."""

    name: str
    ok: bool = False
    status: int = 0  # HTTP status, 0: no reply
    body: dict[str, Any] = field(default_factory=dict)
    message: str = ""
    duration_s: float = 0.0


async def _one(
    session: aiohttp.ClientSession,
    target: Target,
    settings: CallSettings,
    method: str,
    path: str,
    body: dict[str, Any] | None,
    deadline: float,
    limiter: asyncio.Semaphore | None,
) -> PhaseReply:
    reply = PhaseReply(target.name)
    started = time.monotonic()
    timeout = min(settings.request_timeout_s, deadline - started)
    if timeout <= 0.01:
        reply.message = "not called: the update's timeoutSeconds passed"
        return reply
    headers = {"Authorization": f"Bearer {settings.token}"} if settings.token else {}
    try:
        async with (
            limiter or contextlib.nullcontext(),
            session.request(
                method,
                _url(target, settings) + path,
                json=body,
                headers=headers,
                timeout=aiohttp.ClientTimeout(total=timeout),
            ) as resp,
        ):
            # Bounded like every pod reply the fan-out reads: a pod may answer an endless body.
            raw = await read_capped(resp, MAX_REPLY_BYTES)
            text = "" if raw is None else raw.decode("utf-8", "replace")
            reply.status = resp.status
            try:
                parsed = json.loads(text) if text.strip() else None
            except ValueError:
                parsed = None
            reply.body = parsed if isinstance(parsed, dict) else {}
            reply.ok = 200 <= resp.status < 300 and isinstance(parsed, dict)
            if raw is None:
                reply.message = f"HTTP {resp.status}: a reply over {MAX_REPLY_BYTES} bytes"
            elif not reply.ok:
                reply.message = error_message(resp.status, text, settings.token)
    except TimeoutError:
        reply.message = f"no reply within {timeout:.1f}s"
    except aiohttp.ClientError as exc:
        reply.message = f"{type(exc).__name__}: {exc}"
    reply.duration_s = round(time.monotonic() - started, 4)
    return reply


@dataclass(frozen=True, slots=True)
class Step:
    """One call of a per-target sequence; a step that must succeed ends the target's sequence when not ok."""

    method: str
    path: str
    body: dict[str, Any] | None = None
    must_succeed: bool = True


async def run_steps(
    targets: Sequence[Target],
    settings: CallSettings,
    steps: Sequence[Step],
    *,
    deadline: float,
    limiter: asyncio.Semaphore | None = None,
) -> dict[str, list[PhaseReply]]:
    """`steps` in order on each target, the targets side by side (so a target that never answers holds up
    only its own sequence); each target's replies up to its first failed step that must succeed."""
    window = asyncio.Semaphore(max(1, settings.max_concurrency))
    async with aiohttp.ClientSession() as session:

        async def sequence(t: Target) -> list[PhaseReply]:
            replies: list[PhaseReply] = []
            async with window:
                for step in steps:
                    r = await _one(session, t, settings, step.method, step.path, step.body, deadline, limiter)
                    replies.append(r)
                    if step.must_succeed and not r.ok:
                        break
            return replies

        done = await asyncio.gather(*(sequence(t) for t in targets))
    return {t.name: replies for t, replies in zip(targets, done, strict=True)}


async def run_phase(
    targets: Sequence[Target],
    settings: CallSettings,
    method: str,
    path: str,
    body: dict[str, Any] | None = None,
    *,
    deadline: float,
    limiter: asyncio.Semaphore | None = None,
) -> dict[str, PhaseReply]:
    """`method path` (JSON `body`) once on every target, at most settings.max_concurrency at a time, each call
    bounded by settings.request_timeout_s and the deadline; the replies by target name."""
    window = asyncio.Semaphore(max(1, settings.max_concurrency))
    async with aiohttp.ClientSession() as session:

        async def bounded(t: Target) -> PhaseReply:
            async with window:
                return await _one(session, t, settings, method, path, body, deadline, limiter)

        replies = await asyncio.gather(*(bounded(t) for t in targets))
    return {r.name: r for r in replies}
