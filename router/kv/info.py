"""What a pod says of its KV events, checked before the router acts on it: a kvpilot daemon's
`GET /kv_events`, or a vLLM pod's `GET /kv_event_sources` (vLLM 0.32: each rank's publisher config, keyed
by rank; a wildcard bind, `tcp://*:5557`, is named by the pod's own address).

The reply comes from the pod, so each field is checked for its type and range and anything off is a
ValueError naming the field: the pod is then routed by load until a later probe reads a good reply. What
the pod advertises bounds what the router takes from it later: its replay answers (`buffer_batches`,
`buffer_bytes`) and each rank's index entry (`blocks_total`), each within a ceiling of the router's own,
since a pod may advertise anything. The index's ceiling is the pod's, shared by its ranks: a pod that
claims 256 ranks costs the router no more than one of a single rank, and two ranks naming one socket (each
rank publishes on its own) are refused, as every key they sent would be indexed once per rank.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import Any

from kvpilot.kv.block_keys import KeyScheme, scheme_from_wire
from kvpilot.kv.events import DEFAULT_BUFFER_BATCHES, DEFAULT_BUFFER_BYTES
from kvpilot.router.kv.index import MAX_BLOCKS_PER_HOLDER
from kvpilot.router.kv.replay import ReplayLimits

MAX_REPLY_BYTES = 1 << 20  # a reply naming 256 ranks is ~40 KiB
MAX_RANKS = 256
MAX_BLOCK_SIZE = 1 << 16
MAX_BLOCKS_PER_POD = MAX_BLOCKS_PER_HOLDER  # indexed keys of one pod, over all its ranks
# Ceilings on the advertised replay buffer: ten times the daemon's defaults.
REPLAY_MAX_BATCHES = 10 * DEFAULT_BUFFER_BATCHES
REPLAY_MAX_BYTES = 4 * DEFAULT_BUFFER_BYTES
# Only TCP: an ipc:// or inproc:// address would point the router at sockets of its own host.
_RANK = re.compile(r"0|[1-9][0-9]{0,2}")
# A host as libzmq's connect takes it: a bracketed IPv6 address, or dot-separated labels of letters, digits,
# '-' and '_', each starting with a letter or digit (`tcp://-:5557` passed a looser pattern, then failed to
# connect every second).
_ENDPOINT = re.compile(
    r"tcp://(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9][A-Za-z0-9_-]*(?:\.[A-Za-z0-9][A-Za-z0-9_-]*)*):[0-9]{1,5}"
)


@dataclass(frozen=True, slots=True)
class RankEvents:
    rank: int
    endpoint: str
    replay_endpoint: str | None
    # The rank's pool as the pod says (None: it does not); parsed, within its share of the pod's ceiling.
    blocks_total: int | None


@dataclass(frozen=True, slots=True)
class PodEvents:
    block_size: int
    ranks: list[RankEvents]
    limits: ReplayLimits
    keys: KeyScheme  # how the pod keys its blocks (`block_hash`, `hash_seed`)


def parse_kv_events(info: Any) -> PodEvents:
    """The checked content of a `GET /kv_events` reply (JSON already decoded); ValueError if off."""
    if not isinstance(info, dict):
        raise ValueError(f"the reply is a JSON {type(info).__name__}, not an object")
    block_size = _int(info, "block_size", 1, MAX_BLOCK_SIZE)
    listed = info.get("ranks") or [info]  # a daemon from before data parallelism names rank 0 only
    if not isinstance(listed, list) or len(listed) > MAX_RANKS:
        raise ValueError(f"ranks must be a list of at most {MAX_RANKS}")
    ranks = _pod_shares([_rank(r) for r in listed])
    batches = _int(info, "buffer_batches", 0, None, DEFAULT_BUFFER_BATCHES)
    size = _int(info, "buffer_bytes", 0, None, DEFAULT_BUFFER_BYTES)
    limits = ReplayLimits(batches=min(batches, REPLAY_MAX_BATCHES), bytes=min(size, REPLAY_MAX_BYTES))
    return PodEvents(
        block_size, ranks, limits, scheme_from_wire(info.get("block_hash"), info.get("hash_seed"))
    )


def parse_kv_event_sources(info: Any, pod_host: str, block_size: int, keys: KeyScheme) -> PodEvents | None:
    """The checked content of a vLLM pod's `GET /kv_event_sources` reply (None: `{}`, events off); vLLM
    names neither its block size nor its key scheme, so the router's settings give both."""
    if not isinstance(info, dict):
        raise ValueError(f"the reply is a JSON {type(info).__name__}, not an object")
    if len(info) > MAX_RANKS:
        raise ValueError(f"names more than {MAX_RANKS} ranks")
    ranks = []
    for name, config in info.items():
        # a rank as vLLM writes it: ASCII digits, no leading zero (so "1" and "01" are never one rank twice)
        if not (_RANK.fullmatch(name) and int(name) < MAX_RANKS) or not isinstance(config, dict):
            raise ValueError("each entry must be a rank number naming a JSON object")
        replay = config.get("replay_endpoint")
        ranks.append(
            RankEvents(
                rank=int(name),
                endpoint=checked_endpoint(_at_pod(config.get("endpoint"), pod_host), "endpoint"),
                replay_endpoint=None
                if replay is None
                else checked_endpoint(_at_pod(replay, pod_host), "replay_endpoint"),
                blocks_total=None,
            )
        )
    if not ranks:
        return None
    limits = ReplayLimits(batches=DEFAULT_BUFFER_BATCHES, bytes=DEFAULT_BUFFER_BYTES)
    return PodEvents(block_size, _pod_shares(sorted(ranks, key=lambda r: r.rank)), limits, keys)


def _pod_shares(ranks: list[RankEvents]) -> list[RankEvents]:
    """The ranks, each with its share of the pod's index ceiling as `blocks_total` (its advertised pool
    within that share); ValueError when two name one rank or one socket."""
    if len({r.rank for r in ranks}) != len(ranks):
        raise ValueError("ranks names a rank twice")
    if len({r.endpoint for r in ranks}) != len(ranks):
        raise ValueError("two ranks name one endpoint (each rank publishes on a socket of its own)")
    share = MAX_BLOCKS_PER_POD // max(1, len(ranks))
    return [replace(r, blocks_total=min(r.blocks_total or share, share)) for r in ranks]


def static_event_source(endpoint: str, block_size: int, keys: KeyScheme) -> PodEvents:
    """A pod's one publisher, named by the router's --kv-event-source (checked when the flag was read)
    rather than by the pod: rank 0, no replay socket (a gap in its sequence then empties the pod's entries
    instead of replaying them)."""
    limits = ReplayLimits(batches=DEFAULT_BUFFER_BATCHES, bytes=DEFAULT_BUFFER_BYTES)
    rank = RankEvents(rank=0, endpoint=endpoint, replay_endpoint=None, blocks_total=None)
    return PodEvents(block_size, [rank], limits, keys)


def _at_pod(value: Any, pod_host: str) -> Any:
    """A bind address as a connectable one: a wildcard host (`*`, 0.0.0.0, ::) becomes the pod's."""
    if not isinstance(value, str):
        return value
    head, sep, port = value.rpartition(":")
    if head in ("tcp://*", "tcp://0.0.0.0", "tcp://[::]", "tcp://::"):
        host = f"[{pod_host}]" if ":" in pod_host else pod_host
        return f"tcp://{host}{sep}{port}"
    return value


def _rank(r: Any) -> RankEvents:
    if not isinstance(r, dict):
        raise ValueError("a rank is not a JSON object")
    replay = r.get("replay_endpoint")
    return RankEvents(
        rank=_int(r, "rank", 0, MAX_RANKS - 1, 0),
        endpoint=checked_endpoint(r.get("endpoint"), "endpoint"),
        replay_endpoint=None if replay is None else checked_endpoint(replay, "replay_endpoint"),
        blocks_total=_int(r, "blocks_total", 1, None, None),
    )


def checked_endpoint(value: Any, name: str) -> str:
    if not isinstance(value, str) or len(value) > 300 or not _ENDPOINT.fullmatch(value):
        raise ValueError(f"{name} is not a tcp://HOST:PORT address")
    return value


_MISSING = object()


def _int(obj: dict[str, Any], name: str, low: int, high: int | None, default: Any = _MISSING) -> Any:
    """obj[name] as an int in [low, high]; `default` when absent or null (required without one)."""
    value = obj.get(name)
    if value is None:
        if default is _MISSING:
            raise ValueError(f"{name} is missing")
        return default
    if type(value) is not int or value < low or (high is not None and value > high):
        raise ValueError(f"{name} must be an integer from {low}" + (f" to {high}" if high else " up"))
    return value
