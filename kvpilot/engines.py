"""What kvpilot knows about each engine a fleet's pods may run: kvpilot, vLLM and SGLang. The one home of
these facts: the fan-out resets pods by them (`kvpilot.fanout.engines` adds how each reset is called and
its reply judged), the router probes and keys pods by them, and every `--engine` flag takes its choices
from here. Light on purpose: `kvpilot --help` imports it.

- kvpilot: `GET /health` 200, naming its weight version; `GET /kv_events` names its event sockets;
  `GET /prefix_cache` its tiers and data-parallel ranks; resets scoped to an adapter, salt or weight
  version. The router counts its own open requests as a pod's load (the daemon's events and replies are
  what it trusts) and routes by prefix by default.
- vLLM (0.32): `GET /health` 200 (503 once its engine died); `GET /kv_event_sources` names each rank's
  event sockets when the pod runs with `--kv-events-config` (`{}` without), keyed as vLLM keys blocks
  (the router's `--kv-events-hash-algo` and `--kv-events-block-size`: vLLM names neither), so prefix-aware
  routing is a choice, not the default; load: `vllm:num_requests_running` plus `vllm:num_requests_waiting`
  from `GET /metrics`, summed over their series (one per engine, i.e. DP rank).
- SGLang (0.5.x): `GET /health` 200 (503 while starting or shutting down); `GET /server_info` (before 0.5
  `/get_server_info`) names its HiCache tiers; load: `sglang:num_running_reqs` plus `sglang:num_queue_reqs`,
  served only with `--enable-metrics` (without, the router counts its own open requests); its completions
  take no `cache_salt`; no KV events the router can follow.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class EngineTraits:
    name: str
    health_path: str = "/health"
    # Where a pod names its KV event sockets; None: the engine publishes none the router can follow.
    kv_events_path: str | None = None
    prefix_aware_default: bool = False  # the router routes its pods by prefix unless told otherwise
    weight_version: bool = False  # its health reply names the weight version its block keys carry
    load_metrics: tuple[str, ...] = ()  # summed into a pod's load; empty: the router counts its own requests
    # GETs, tried in order until one answers a JSON object, whose reply says which tiers and how many
    # data-parallel ranks the pod runs (empty: nothing to ask).
    info_paths: tuple[str, ...] = ()
    scoped_resets: bool = False  # resets one adapter's, salt's or weight version's blocks
    cache_salt: bool = False  # its completions take `cache_salt` (a canary salted apart from real traffic)


KVPILOT = EngineTraits(
    "kvpilot",
    kv_events_path="/kv_events",
    prefix_aware_default=True,
    weight_version=True,
    info_paths=("/prefix_cache",),
    scoped_resets=True,
    cache_salt=True,
)
VLLM = EngineTraits(
    "vllm",
    kv_events_path="/kv_event_sources",
    load_metrics=("vllm:num_requests_running", "vllm:num_requests_waiting"),
    cache_salt=True,
)
SGLANG = EngineTraits(
    "sglang",
    load_metrics=("sglang:num_running_reqs", "sglang:num_queue_reqs"),
    info_paths=("/server_info", "/get_server_info"),
)

ENGINES: dict[str, EngineTraits] = {e.name: e for e in (KVPILOT, VLLM, SGLANG)}
ENGINE_NAMES = tuple(ENGINES)


def traits_of(name: str) -> EngineTraits:
    try:
        return ENGINES[name]
    except KeyError:
        raise ValueError(f"unknown engine {name!r}; known: {', '.join(ENGINES)}") from None
