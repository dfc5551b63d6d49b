"""A request's `kv_transfer_params`, served (docs/disaggregation.md): a prefill for a remote decode holds
its prompt's KV and its reply says where to pull it; a decode of a remote prefill pulls, before it runs, the
blocks its pool lacks. The params come from a client (a router): every field is checked and bounded here,
and a pull that cannot be had whole is counted and skipped (the prompt is computed here), never an error.
"""

from __future__ import annotations

import logging
import secrets
import time
from dataclasses import dataclass
from typing import Any

from kvpilot.daemon.engine.client import EngineClient, EngineRequest
from kvpilot.daemon.engine.outputs import RequestOutput
from kvpilot.daemon.kv_transfer.connector import KVConnector
from kvpilot.daemon.kv_transfer.held import HeldSummary
from kvpilot.daemon.kv_transfer.pull import PullFailed, PullRequest, pull, release
from kvpilot.daemon.kv_transfer.remote import RemoteBlocks
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


@dataclass(frozen=True, slots=True)
class RemotePrefill:
    """Where a decode request's prompt KV waits: a prefill pod's hold, as its reply described it."""

    host: str
    port: int
    hold_id: str
    keys: list[BlockHash]
    epoch: int
    block_size: int


@dataclass(frozen=True, slots=True)
class TransferAsk:
    """What a request's kv_transfer_params ask of this pod: hold its prompt (`hold_id`) or pull one."""

    hold_id: str | None = None
    remote: RemotePrefill | None = None


def parse_ask(
    req: GenerateRequest, connector: KVConnector | None, prompts: int, max_blocks: int
) -> TransferAsk | None:
    """The request's ask, checked against this pod's role (None: it asks nothing); a 400 naming the field
    for what cannot be served. `max_blocks`: the most full blocks a prompt of this pod's context has."""
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
    return TransferAsk(remote=_remote_prefill(params, max_blocks))


def _remote_prefill(p: dict[str, Any], max_blocks: int) -> RemotePrefill:
    def field(name: str, kind: type, ok: Any) -> Any:
        value = p.get(name)
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
        host=field("remote_host", str, lambda v: 0 < len(v) <= MAX_HOST_CHARS),
        port=field("remote_port", int, lambda v: 0 < v < 65536),
        hold_id=field("remote_request_id", str, lambda v: 0 < len(v) <= MAX_ID_CHARS),
        keys=keys,
        epoch=field("remote_epoch", int, lambda v: v >= 0),
        block_size=field("block_size", int, lambda v: v > 0),
    )


async def pull_prefix(
    engine: EngineClient, metrics: TransferMetrics, request: EngineRequest, remote: RemotePrefill
) -> RemoteBlocks | None:
    """The blocks of the prompt this pod should land (None: nothing to land; a failure is counted)."""
    connector = engine.kv_connector
    assert connector is not None  # parse_ask asked for a consumer
    keys = remote.keys[
        : engine.info.max_model_len // engine.info.block_size
    ]  # more blocks cannot be a prompt's
    if not keys:
        return None  # nothing was held
    plan = await engine.plan_pull(request, keys) if remote.block_size == engine.info.block_size else None
    if plan is None or plan.count == 0:
        if plan is None or plan.matched == 0:  # another block size, or keys of other weights, salt or seed
            metrics.failed("incompatible")
        await release(remote.host, remote.port, remote.hold_id, connector.config.pull_timeout_s)
        return None
    ask = PullRequest(remote.host, remote.port, remote.hold_id, plan.first, plan.count, remote.epoch)
    start = time.perf_counter()
    connector.pulls_in_flight += 1
    try:
        data = await pull(ask, connector.block_shape, connector.dtype, connector.config.pull_timeout_s)
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


@dataclass(frozen=True, slots=True)
class HoldReply:
    """A prefill for a remote decode, as its reply names it: the hold and the host the request reached
    (which the decode pod reaches this pod at, as `GET /kv_events` answers)."""

    hold_id: str
    host: str


def reply_params(connector: KVConnector, hold: HoldReply, finals: list[RequestOutput]) -> dict[str, Any]:
    """The prefill reply's `kv_transfer_params`: what a decode pod needs to pull the hold (vLLM's names,
    and the block keys kvpilot pulls by)."""
    held = next((o.held for o in finals if o.held is not None), None) or HeldSummary((), 0)
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_engine_id": connector.engine_id,
        "remote_request_id": hold.hold_id,
        "remote_host": hold.host,
        "remote_port": connector.port,
        "remote_block_ids": list(range(len(held.keys))),
        "remote_block_keys": [k.hex() for k in held.keys],
        "remote_epoch": held.epoch,
        "block_size": connector.block_shape[2],
        "tp_size": 1,
    }
