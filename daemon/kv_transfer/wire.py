"""The KV-transfer protocol on the wire, both ends: length-prefixed JSON frames around the raw blocks.

    decode -> prefill   b"KVP1", frame {"hold": id, "first": i, "count": n}    (n 0: a release, answered
                        by a header alone)
    prefill -> decode   frame {"ok": true, "epoch": e, "dtype": "float32", "block_shape": [...], "count": n}
                        n blocks' bytes, as the prefill pod's KV dtype lays them out
                        frame {"epoch": e'}     (the prefill pod's epoch once the last byte is sent)
                   or   frame {"ok": false, "reason": "gone" | "bad_request"}

A frame is a 4-byte big-endian length and that many bytes of JSON, at most `MAX_FRAME_BYTES`: both ends read
no more than they asked for, so a peer cannot make either buffer what it likes.
"""

from __future__ import annotations

import asyncio
import json
import struct
from typing import Any, cast

import torch

MAGIC = b"KVP1"
MAX_FRAME_BYTES = 4 << 10
_LENGTH = struct.Struct(">I")
# The KV dtypes a daemon runs with (engine/config.py DTYPES), by their wire names.
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}


class WireError(Exception):
    """The peer broke the protocol (a frame too long, not JSON, not an object)."""


def frame(obj: dict[str, Any]) -> bytes:
    body = json.dumps(obj, separators=(",", ":")).encode()
    return _LENGTH.pack(len(body)) + body


async def read_frame(reader: asyncio.StreamReader) -> dict[str, Any]:
    (n,) = _LENGTH.unpack(await reader.readexactly(_LENGTH.size))
    if n > MAX_FRAME_BYTES:
        raise WireError(f"a frame of {n} bytes (at most {MAX_FRAME_BYTES})")
    try:
        obj = json.loads(await reader.readexactly(n))
    except ValueError:
        raise WireError("a frame that is not JSON") from None
    if not isinstance(obj, dict):
        raise WireError("a frame that is not a JSON object")
    return obj


def as_bytes(blocks: torch.Tensor) -> memoryview:
    """A contiguous host tensor's bytes, without a copy (any dtype, bfloat16 included)."""
    flat = blocks.contiguous().view(-1).view(torch.uint8).numpy()
    return memoryview(cast(bytes, flat))  # an ndarray is a buffer; numpy's stubs do not say so
