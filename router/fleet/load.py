"""A pod's load from its own metrics, for the engines that serve it (`EngineTraits.load_metrics`,
`kvpilot/engines.py`: vLLM's and SGLang's request gauges; a kvpilot pod's load is the requests this router
has open on it).

A pod's /metrics is read with bounds (bytes and seconds) and parsed defensively: only the exact metric
names count (`vllm:num_requests_waiting_by_reason` is not `vllm:num_requests_waiting`), and a malformed or
negative sample makes the load unknown rather than wrong.
"""

from __future__ import annotations

import math

import aiohttp

from kvpilot.engines import EngineTraits
from kvpilot.serving.capped_read import read_capped

METRICS_MAX_BYTES = 4 << 20  # a vLLM pod with histograms for a few models sends ~100 KiB
METRICS_TIMEOUT_S = 2.0  # the whole read; the probe loop comes back every 2 s anyway


def parse_load(text: str, names: tuple[str, ...]) -> int | None:
    """The sum of every sample of `names` in a Prometheus text exposition; None unless each name has a
    sample and every one of their samples is a finite, non-negative number."""
    totals = dict.fromkeys(names, 0.0)
    seen: set[str] = set()
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        end = _name_end(line)
        name = line[:end]
        if name not in totals:
            continue
        rest = line[end:]
        if rest.startswith("{"):
            close = _labels_end(rest)
            if close < 0:
                return None
            rest = rest[close + 1 :]
        fields = rest.split()
        try:
            value = float(fields[0])
        except (IndexError, ValueError):
            return None
        if not math.isfinite(value) or value < 0:
            return None
        totals[name] += value
        seen.add(name)
    total = sum(totals.values())
    if len(seen) != len(names) or not math.isfinite(total):  # finite samples may still sum past a float
        return None
    return round(total)


def _name_end(line: str) -> int:
    for i, ch in enumerate(line):
        if ch == "{" or ch.isspace():
            return i
    return len(line)


def _labels_end(text: str) -> int:
    """Index of the `}` closing the label set `text` starts with (quoted values may hold `}` and `\\"`);
    -1 when it is not closed."""
    quoted = escaped = False
    for i, ch in enumerate(text):
        if escaped:
            escaped = False
        elif ch == "\\":
            escaped = quoted
        elif ch == '"':
            quoted = not quoted
        elif ch == "}" and not quoted:
            return i
    return -1


async def read_load(
    session: aiohttp.ClientSession,
    url: str,
    engine: EngineTraits,
    max_bytes: int = METRICS_MAX_BYTES,
    timeout_s: float = METRICS_TIMEOUT_S,
) -> tuple[int | None, str]:
    """(the pod's load from GET url/metrics, "") or (None, why not)."""
    try:
        async with session.get(
            url + "/metrics",
            headers={"Accept": "text/plain"},  # the classic text format, not OpenMetrics
            timeout=aiohttp.ClientTimeout(total=timeout_s),
        ) as r:
            if r.status != 200:
                return None, f"GET /metrics answered {r.status}"
            body = await read_capped(r, max_bytes)
            if body is None:
                return None, f"GET /metrics sent more than {max_bytes} bytes"
    except TimeoutError:
        return None, f"GET /metrics took longer than {timeout_s:g}s"
    except aiohttp.ClientError as exc:
        return None, f"GET /metrics failed: {type(exc).__name__}"
    load = parse_load(body.decode("utf-8", errors="replace"), engine.load_metrics)
    if load is None:
        return None, f"GET /metrics has no valid {' and '.join(engine.load_metrics)}"
    return load, ""
