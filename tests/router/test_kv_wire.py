"""The KV events' wire layout (kvpilot/kv/events.py): vLLM's tagged maps, read by vLLM's own structs
(vLLM 0.33.0's vllm/distributed/kv_events.py with msgspec, as vLLM's consumers decode), kvpilot's weight
version carried where vLLM's decoder passes over it; vLLM's own encoding read by the router; and the
older array layout, which daemons before it sent, still followed by the router's stream."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import msgpack
import pytest
import zmq.asyncio

from kvpilot.kv import events as kv_events
from kvpilot.kv.block_keys import key_scheme
from kvpilot.kv.events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch
from kvpilot.router.kv.index import PrefixIndex
from kvpilot.router.kv.stream import PodEventStream
from support import vllm_client
from support.vllm_kv_events import KV_CACHE_UTILS_LINE

pytestmark = pytest.mark.timeout(300)

K = key_scheme().prompt_hashes(list(range(64)), 16)  # four chained kvpilot keys
BATCHES = [
    EventBatch(1.5, [BlockStored(K[:2], None, [], 16), BlockStored(K[2:], K[1], list(range(32, 64)), 16)], 0),
    EventBatch(2.5, [BlockRemoved(K[3:]), AllBlocksCleared()], 1),
    EventBatch(3.5, [AllBlocksCleared("v2"), BlockStored(K[:1], None, [], 16)], 0),
    # the offload tiers' media, as vLLM's offloading connector names them
    EventBatch(4.0, [BlockStored(K[3:], None, [], 16, "CPU"), BlockRemoved(K[3:], "STORAGE")], 0),
]


@pytest.fixture(scope="module")
def vllm_client_dir() -> Path:
    return vllm_client.vllm_client_dir()


def _ordered(value: object) -> object:
    """A msgpack value with each map as its (key, value) pairs in wire order: vLLM's field order counts."""
    if isinstance(value, dict):
        return [(k, _ordered(v)) for k, v in value.items()]
    if isinstance(value, list):
        return [_ordered(v) for v in value]
    return value


def test_vllms_own_structs_decode_kvpilots_batches(vllm_client_dir: Path) -> None:
    source = (vllm_client_dir / "vllm/v1/core/kv_cache_utils.py").read_text()
    assert KV_CACHE_UTILS_LINE in source  # the one name stood in, as vLLM defines it
    big = EventBatch(4.5, [BlockStored(K * 300, None, [], 16) for _ in range(40)], 0)
    split = kv_events.encode_batches(big)
    assert len(split) > 1  # a step split into messages: each one a batch of vLLM's shape
    payloads = [kv_events.encode_batch(b) for b in BATCHES] + split
    env = os.environ | {"PYTHONPATH": str(vllm_client_dir)}
    script = Path(__file__).parents[1] / "support" / "vllm_kv_events.py"
    r = subprocess.run(
        [sys.executable, str(script)],
        input=json.dumps({"payloads": [p.hex() for p in payloads]}),
        capture_output=True,
        text=True,
        env=env,
        timeout=240,
    )
    assert r.returncode == 0, r.stderr[-4000:]
    got = json.loads(r.stdout)

    stored = got[0]["batch"]["events"][1]
    assert stored == {
        "struct": "BlockStored",
        "block_hashes": [K[2].hex(), K[3].hex()],
        "parent_block_hash": K[1].hex(),
        "token_ids": list(range(32, 64)),
        "block_size": 16,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
        "extra_keys": None,
        "group_idx": None,
        "kv_cache_spec_kind": None,
        "kv_cache_spec_sliding_window": None,
        "locality": None,
        "ownership": None,
        "session_id": None,
        "lookahead_token_ids": None,
    }
    removed, cleared = got[1]["batch"]["events"]
    assert removed["struct"] == "BlockRemoved" and removed["block_hashes"] == [K[3].hex()]
    assert removed["medium"] == "GPU" and cleared == {"struct": "AllBlocksCleared"}
    assert [g["batch"]["ts"] for g in got[:3]] == [1.5, 2.5, 3.5]
    assert [g["batch"]["data_parallel_rank"] for g in got[:3]] == [0, 1, 0]
    # kvpilot's weight version is a field vLLM's struct lacks: vLLM's consumers read a plain clear.
    assert got[2]["batch"]["events"][0] == {"struct": "AllBlocksCleared"}
    offloaded, spilled = got[3]["batch"]["events"]
    assert (offloaded["struct"], offloaded["medium"]) == ("BlockStored", "CPU")
    assert (spilled["struct"], spilled["medium"]) == ("BlockRemoved", "STORAGE")
    assert sum(len(g["batch"]["events"]) for g in got[4:]) == len(big.events)

    # vLLM writes back what it read exactly as kvpilot wrote it, field order included (all but the
    # version, which it dropped): kvpilot's layout is vLLM's.
    for i, (payload, g) in enumerate(zip(payloads, got, strict=True)):
        ours = msgpack.unpackb(payload)
        if i == 2:
            assert ours[1][0] == {"type": "AllBlocksCleared", "weight_version": "v2"}
            ours[1][0] = {"type": "AllBlocksCleared"}
        assert _ordered(msgpack.unpackb(bytes.fromhex(g["reencoded"]))) == _ordered(ours)


def test_the_router_reads_vllms_own_encoding() -> None:
    """What vLLM 0.33's engine sends (msgspec, omit_defaults): the rank left out, 64-bit integer hashes,
    extra_keys and group_idx present, unknown later fields."""
    vllm_stored = {
        "type": "BlockStored",
        "block_hashes": [K[0], K[1]],
        "parent_block_hash": None,
        "token_ids": list(range(32)),
        "block_size": 16,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
        "extra_keys": [None, None],
        "group_idx": 0,
        "session_id": "s",
    }
    payload = msgpack.packb(
        [
            7.0,
            [
                vllm_stored,
                vllm_stored | {"block_hashes": [2**63 + 5], "parent_block_hash": 17, "medium": "CPU"},
                {"type": "BlockRemoved", "block_hashes": [K[1]], "medium": "GPU", "group_idx": 0},
                {"type": "AllBlocksCleared"},
            ],
        ]
    )
    assert kv_events.decode_batch(payload) == EventBatch(
        7.0,
        [
            BlockStored([K[0], K[1]], None, list(range(32)), 16),
            BlockStored([2**63 + 5], 17, list(range(32)), 16, "CPU"),
            BlockRemoved([K[1]]),
            AllBlocksCleared(),
        ],
        0,
    )


def test_the_router_still_follows_the_older_array_layout() -> None:
    """A daemon from before the map layout: its batches, as it encoded them, index the same blocks and
    name the same weight version in the router's stream."""
    old = [
        [1.0, [["BlockStored", K[:3], None, [], 16, None, None, None]], 0],
        [2.0, [["BlockRemoved", K[2:3], None]], 0],
        [3.0, [["AllBlocksCleared", "v2"], ["BlockStored", K[:1], None, [], 16, None, None, None]], 0],
        [4.0, [["BlockStored", K[1:2], K[0], [], 16]]],  # older vLLM: trailing fields and the rank left out
    ]

    async def go() -> list[tuple[int, object]]:
        ctx = zmq.asyncio.Context()
        index = PrefixIndex()
        stream = PodEventStream("p", "tcp://127.0.0.1:1", None, index, lambda *a: None, ctx)
        seen = []
        for seq, batch in enumerate(old):
            await stream.on_message(seq, msgpack.packb(batch))
            seen.append((index.matched_blocks(K, [("p", 0)])[("p", 0)], stream.weight_version))
        ctx.term()
        return seen

    assert asyncio.run(go()) == [(3, None), (2, None), (1, "v2"), (2, "v2")]
    assert kv_events.decode_batch(msgpack.packb(old[2])) == EventBatch(
        3.0, [AllBlocksCleared("v2"), BlockStored(K[:1], None, [], 16)], 0
    )


@pytest.mark.parametrize(
    "batch",
    [
        [1.0, [{"block_hashes": [K[0]]}], 0],  # no tag
        [1.0, [{"type": "BlockStored", "block_hashes": "abc", "parent_block_hash": None, "token_ids": []}]],
        [1.0, [{"type": "BlockRemoved", "block_hashes": {"a": 1}}]],
        [1.0, [{"type": "BlockStored", "block_hashes": [], "parent_block_hash": None, "token_ids": []}]],
        [1.0, [{"type": "Unknown"}]],
        [1.0, [["BlockStored", b"\x00" * 32, None, [], 16]]],  # bytes where the hashes' array goes
        [1.0, ["AllBlocksCleared"]],  # an event that is neither map nor array
        [1.0, {"type": "AllBlocksCleared"}],  # events that are no array
        {"ts": 1.0},
    ],
)
def test_malformed_events_are_refused_in_either_layout(batch: object) -> None:
    with pytest.raises(ValueError, match="not a KV event batch"):
        kv_events.decode_batch(msgpack.packb(batch))
