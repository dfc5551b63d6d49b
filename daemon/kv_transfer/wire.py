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
import socket
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
    """A frame off a stream (the producer's side)."""
    n = _frame_length(await reader.readexactly(_LENGTH.size))
    return _frame_object(await reader.readexactly(n))


class Connection:
    """The consumer's side of one transfer, on a plain non-blocking socket: the blocks are received straight
    into the buffer they stay in (a stream reader would copy them through its own buffer twice, which made a
    pull 5x slower than the socket)."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.loop = asyncio.get_running_loop()

    @classmethod
    async def open(cls, host: str, port: int) -> Connection:
        info = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
        family, kind, proto, _, address = info[0]
        sock = socket.socket(family, kind, proto)
        sock.setblocking(False)
        try:
            await asyncio.get_running_loop().sock_connect(sock, address)
        except BaseException:
            sock.close()
            raise
        return cls(sock)

    async def send(self, data: bytes) -> None:
        await self.loop.sock_sendall(self.sock, data)

    async def receive_into(self, view: memoryview) -> None:
        """Fill `view` exactly; IncompleteReadError if the peer closes first."""
        got = 0
        while got < len(view):
            n = await self.loop.sock_recv_into(self.sock, view[got:])
            if n == 0:
                raise asyncio.IncompleteReadError(bytes(view[:got]), len(view))
            got += n

    async def read_frame(self) -> dict[str, Any]:
        head = bytearray(_LENGTH.size)
        await self.receive_into(memoryview(head))
        body = bytearray(_frame_length(bytes(head)))
        await self.receive_into(memoryview(body))
        return _frame_object(bytes(body))

    def close(self) -> None:
        self.sock.close()


def _frame_length(head: bytes) -> int:
    (n,) = _LENGTH.unpack(head)
    if n > MAX_FRAME_BYTES:
        raise WireError(f"a frame of {n} bytes (at most {MAX_FRAME_BYTES})")
    return int(n)


def _frame_object(body: bytes) -> dict[str, Any]:
    try:
        obj = json.loads(body)
    except (ValueError, RecursionError):  # RecursionError: nested too deep for the parser
        raise WireError("a frame that is not JSON") from None
    if not isinstance(obj, dict):
        raise WireError("a frame that is not a JSON object")
    return obj


def as_bytes(blocks: torch.Tensor) -> memoryview:
    """A contiguous host tensor's bytes, without a copy (any dtype, bfloat16 included)."""
    flat = blocks.contiguous().view(-1).view(torch.uint8).numpy()
    return memoryview(cast(bytes, flat))  # an ndarray is a buffer; numpy's stubs do not say so
