"""A request's `kv_transfer_params`, served (docs/disaggregation.md): a prefill for a remote decode holds
its prompt's KV and its reply says where to pull it; a decode of a remote prefill pulls, before it runs, the
blocks its pool lacks. The params come from a client (a router): every field is checked and bounded here,
and a pull that cannot be had whole is counted and skipped (the prompt is computed here), never an error.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import ipaddress
import json
import logging
import re
import secrets
import time
from dataclasses import dataclass
from typing import Any

from kvpilot.daemon.engine.client import EngineRequest
from kvpilot.daemon.engine.outputs import RequestOutput
from kvpilot.daemon.kv_transfer.connector import KVConnector
from kvpilot.daemon.kv_transfer.held import HeldSummary
from kvpilot.daemon.kv_transfer.pull import PullFailed, PullRequest, pull, release
from kvpilot.daemon.kv_transfer.remote import RemoteBlocks
from kvpilot.daemon.server.app_state import ServerState
from kvpilot.daemon.server.metrics import TransferMetrics
from kvpilot.kv.block_keys import BlockHash
from kvpilot.protocol.errors import bad
from kvpilot.protocol.kv_transfer import KV_TRANSFER, asks
from kvpilot.protocol.requests import GenerateRequest

log = logging.getLogger(__name__)

FIELD = KV_TRANSFER
MAX_HOST_CHARS = 253  # a DNS name's most
MAX_ID_CHARS = 64
MAX_KEY_HEX = 128  # a block key is a 32-byte digest (64 hex digits); room for wider schemes
MAX_MODEL_CHARS = 512
SIGNATURE = "kvpilot_signature"
# Why a decode pod pulled nothing before trying (kvpilot_kv_transfer_failures_total's server-side reasons).
PLAN_REFUSALS = ("untrusted", "busy")
_LABEL = re.compile(r"(?!-)[A-Za-z0-9-]{1,63}(?<!-)")


@dataclass(frozen=True, slots=True)
class RemotePrefill:
    """Where a decode request's prompt KV waits: a prefill pod's hold, as its reply described it."""

    host: str
    port: int
    hold_id: str
    keys: list[BlockHash]
    epoch: int
    block_size: int
    model: str | None  # the producer's model@weights (remote_model)
    trusted: bool  # signed with the fleet's key (kvpilot_signature), or this daemon has no admin token


@dataclass(frozen=True, slots=True)
class TransferAsk:
    """What a request's kv_transfer_params ask of this pod: hold its prompt (`hold_id`) or pull one."""

    hold_id: str | None = None
    remote: RemotePrefill | None = None


def transfer_key(admin_token: str | None) -> bytes | None:
    """The key a fleet's prefill replies are signed with: derived from the admin token the fleet's pods
    share, so no client can hand a decode pod params of its own (where to connect, what to land under which
    keys) as if a prefill pod had made them. None without an admin token: an open daemon trusts its clients,
    for this as for its resets."""
    if admin_token is None:
        return None
    return hashlib.sha256(b"kvpilot-kv-transfer\0" + admin_token.encode()).digest()


SIGNED = (
    "remote_host",
    "remote_port",
    "remote_request_id",
    "remote_block_keys",
    "remote_epoch",
    "block_size",
    "remote_model",
)


def signature(key: bytes, params: dict[str, Any]) -> str:
    """The HMAC of a prefill reply's params, over the fields a decode pod acts on (where it connects, what it
    pulls, under which keys it lands)."""
    signed = json.dumps([params.get(name) for name in SIGNED], separators=(",", ":"))
    return hmac.new(key, signed.encode(), hashlib.sha256).hexdigest()


def parse_ask(
    req: GenerateRequest, connector: KVConnector | None, prompts: int, max_blocks: int, key: bytes | None
) -> TransferAsk | None:
    """The request's ask, checked against this pod's role (None: it asks nothing); a 400 naming the field
    for what cannot be served. `max_blocks`: the most full blocks a prompt of this pod's context has; `key`:
    the fleet's (`transfer_key`), which a remote prefill's params must be signed with."""
    params = req.kv_transfer_params
    if params is None or not asks(params):
        return None
    if connector is None:
        raise bad(
            f"'{FIELD}' asks for prefill/decode disaggregation (do_remote_decode, do_remote_prefill): this "
            "server has no KV connector (start it with --kv-transfer-config)",
            FIELD,
        )
    if prompts != 1 or req.params.n != 1:
        raise bad(f"'{FIELD}' is served for one prompt and one sequence (n, best_of 1)", FIELD)
    role = connector.config.role
    if asks(params, "do_remote_decode"):
        if not connector.config.produces:
            raise bad(f"'{FIELD}': do_remote_decode asks for a prefill; this pod is a {role}", FIELD)
        if req.stream:
            raise bad(f"'{FIELD}': a prefill for a remote decode is answered whole: set stream false", FIELD)
        return TransferAsk(hold_id=secrets.token_hex(16))
    if not connector.config.consumes:
        raise bad(f"'{FIELD}': do_remote_prefill asks for a decode; this pod is a {role}", FIELD)
    return TransferAsk(remote=_remote_prefill(params, max_blocks, key))


def _remote_prefill(p: dict[str, Any], max_blocks: int, key: bytes | None) -> RemotePrefill:
    def field(name: str, kind: type, ok: Any, optional: bool = False) -> Any:
        value = p.get(name)
        if optional and value is None:
            return None
        if not isinstance(value, kind) or isinstance(value, bool) or not ok(value):
            raise bad(f"'{FIELD}.{name}' is missing or out of range", f"{FIELD}.{name}")
        return value

    keys_hex = field("remote_block_keys", list, lambda v: len(v) <= max_blocks)
    keys = []
    for k in keys_hex:
        if not isinstance(k, str) or not 0 < len(k) <= MAX_KEY_HEX:
            raise bad(f"'{FIELD}.remote_block_keys' holds hex block keys", f"{FIELD}.remote_block_keys")
        try:
            keys.append(BlockHash(bytes.fromhex(k)))
        except ValueError:
            raise bad(
                f"'{FIELD}.remote_block_keys' holds hex block keys", f"{FIELD}.remote_block_keys"
            ) from None
    return RemotePrefill(
        host=field("remote_host", str, _is_host),
        port=field("remote_port", int, lambda v: 0 < v < 65536),
        hold_id=field("remote_request_id", str, lambda v: 0 < len(v) <= MAX_ID_CHARS),
        keys=keys,
        epoch=field("remote_epoch", int, lambda v: v >= 0),
        block_size=field("block_size", int, lambda v: v > 0),
        model=field("remote_model", str, lambda v: len(v) <= MAX_MODEL_CHARS, optional=True),
        trusted=key is None
        or (isinstance(sig := p.get(SIGNATURE), str) and hmac.compare_digest(sig, signature(key, p))),
    )


def _is_host(value: str) -> bool:
    """An IP address, or a DNS name whose labels the resolver takes (a malformed one raised from deep in
    getaddrinfo, past the pull's own errors)."""
    try:
        ipaddress.ip_address(value)
        return True
    except ValueError:
        return 0 < len(value) <= MAX_HOST_CHARS and all(_LABEL.fullmatch(x) for x in value.split("."))


async def pull_prefix(
    state: ServerState, request: EngineRequest, remote: RemotePrefill
) -> RemoteBlocks | None:
    """The blocks of the prompt this pod should land (None: nothing to land; why is counted). Nothing is
    pulled, and no connection made, for params this fleet did not sign (with an admin token), of another
    model or weights, when the pod pulls its most at once already, or for a request that recomputes its
    prompt anyway (prompt logprobs)."""
    engine, metrics = state.engine, state.metrics.transfer
    connector = engine.kv_connector
    assert connector is not None and metrics is not None  # parse_ask asked for a consumer
    keys = remote.keys
    if not keys:
        return None  # nothing was held
    if not remote.trusted:
        metrics.failed("untrusted")
        log.warning("KV transfer: params not signed by this fleet (another admin token?); computing here")
        return None
    cfg = connector.config
    if remote.block_size != engine.info.block_size or remote.model not in (None, model_identity(state)):
        return _skip(remote, cfg.pull_timeout_s, metrics, "incompatible")
    try:
        plan = await engine.plan_pull(request, keys)
    except ValueError:  # RequestRejected (an adapter gone since parsing): the engine's add says so
        return _skip(remote, cfg.pull_timeout_s, metrics, None)
    if plan.matched == 0:  # keys of other weights, salt, adapter or hash seed
        return _skip(remote, cfg.pull_timeout_s, metrics, "incompatible")
    if plan.count == 0 or request.params.prompt_logprobs is not None:  # nothing it would land
        return _skip(remote, cfg.pull_timeout_s, metrics, None)
    if connector.pulls_in_flight >= cfg.max_pulls:
        return _skip(remote, cfg.pull_timeout_s, metrics, "busy")
    ask = PullRequest(remote.host, remote.port, remote.hold_id, plan.first, plan.count, remote.epoch)
    start = time.perf_counter()
    connector.pulls_in_flight += 1
    try:
        data = await pull(ask, connector.block_shape, connector.dtype, cfg.pull_timeout_s, connector.pinned)
    except PullFailed as exc:
        metrics.failed(exc.reason)
        log.warning(
            "KV transfer: pulling %d blocks from %s:%d failed (%s); computing them here",
            plan.count,
            remote.host,
            remote.port,
            exc,
        )
        return None
    finally:
        connector.pulls_in_flight -= 1  # a client gone mid-pull cancels it: counted out all the same
    metrics.received(plan.count, data.numel() * data.element_size(), time.perf_counter() - start)
    keys_pulled = tuple(keys[plan.first : plan.first + plan.count])
    return RemoteBlocks(plan.first, keys_pulled, data, plan.generation)


_RELEASES: set[asyncio.Task[None]] = set()  # kept until done: the loop holds tasks only weakly


def _skip(
    remote: RemotePrefill, timeout_s: float, metrics: TransferMetrics, reason: str | None
) -> RemoteBlocks | None:
    """`pull_prefix`'s answer when it pulls nothing (None; `reason`, when it is a failure, counted): the
    prefill pod is let drop the hold beside the request, so a slow or silent producer never holds the
    client's answer up."""
    if reason is not None:
        metrics.failed(reason)
    task = asyncio.get_running_loop().create_task(
        release(remote.host, remote.port, remote.hold_id, timeout_s)
    )
    _RELEASES.add(task)
    task.add_done_callback(_RELEASES.discard)
    return None


def model_identity(state: ServerState) -> str:
    """The model and weights a pod serves, as a prefill reply names them (remote_model): KV of other
    weights is never landed, named versions or not."""
    return f"{state.engine.info.model_name}@{state.weights.digest or state.weights.version}"


@dataclass(frozen=True, slots=True)
class HoldReply:
    """A prefill for a remote decode, as its reply names it: the hold and the host the request reached
    (which the decode pod reaches this pod at, as `GET /kv_events` answers)."""

    hold_id: str
    host: str


def reply_params(state: ServerState, hold: HoldReply, finals: list[RequestOutput]) -> dict[str, Any]:
    """The prefill reply's `kv_transfer_params`: what a decode pod needs to pull the hold (vLLM's names, and
    kvpilot's: the block keys it pulls by, the epoch, the model; signed with the fleet's key)."""
    connector = state.engine.kv_connector
    assert connector is not None and connector.port is not None  # a producer: its server listens
    held = next((o.held for o in finals if o.held is not None), None) or HeldSummary((), 0)
    keys = [k.hex() for k in held.keys]
    params: dict[str, Any] = {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_engine_id": connector.engine_id,
        "remote_request_id": hold.hold_id,
        "remote_host": hold.host,
        "remote_port": connector.port,
        "remote_block_ids": list(range(len(keys))),
        "remote_block_keys": keys,
        "remote_epoch": held.epoch,
        "block_size": connector.block_shape[2],
        "remote_model": model_identity(state),
        "tp_size": 1,
    }
    if state.transfer_key is not None:
        params[SIGNATURE] = signature(state.transfer_key, params)
    return params
