"""The prefill side of a transfer: a TCP server on the KV-transfer port that hands each hold to one pull.

Every connection is bounded: one request frame of at most a few KiB, read within `timeout_s`; the whole
send within the same time (a decode pod that stops reading is dropped, not waited on); at most
`MAX_CONNECTIONS` at once. A hold id is 128 random bits given only in the prefill's reply, and one pull
(or a release: a pull of no blocks, from a decode pod whose pool holds the whole prefix already) spends it: another pod cannot guess one, nor pull a prompt twice (docs/security.md).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from kvpilot.daemon.kv_transfer.held import Held, HeldKV
from kvpilot.daemon.kv_transfer.wire import DTYPE_NAMES, MAGIC, WireError, as_bytes, frame, read_frame

log = logging.getLogger(__name__)

MAX_CONNECTIONS = 64
SEND_CHUNK_BYTES = 1 << 20
MAX_HOLD_ID_CHARS = 64

# Told of each pull served: (blocks, bytes).
OnSent = Callable[[int, int], None]


class TransferPortError(OSError):
    """The transfer port cannot be listened on (most often: taken), named as such at startup."""


class TransferServer:
    def __init__(self, held: HeldKV, host: str, port: int, timeout_s: float, on_sent: OnSent) -> None:
        self.held, self.host, self.port = held, host, port
        self.timeout_s = timeout_s
        self.on_sent = on_sent
        self._server: asyncio.Server | None = None
        self._open = 0

    async def start(self) -> int:
        """Listen; returns the port (the one the OS chose for port 0)."""
        try:
            self._server = await asyncio.start_server(self._serve, self.host, self.port)
        except OSError as exc:
            raise TransferPortError(
                exc.errno,
                f"cannot listen on the KV transfer port {self.host}:{self.port} (--kv-transfer-config "
                f"kv_connector_extra_config.port): {exc.strerror or exc}",
            ) from None
        self.port = self._server.sockets[0].getsockname()[1]
        log.info("KV transfer: serving pulls of held prefills on %s:%d", self.host, self.port)
        return self.port

    @property
    def sending(self) -> int:
        """Connections open now (pulls being served)."""
        return self._open

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self._open >= MAX_CONNECTIONS:
            writer.close()
            return
        self._open += 1
        try:
            await asyncio.wait_for(self._pull(reader, writer), self.timeout_s)
        except (TimeoutError, WireError, ConnectionError, asyncio.IncompleteReadError) as exc:
            log.warning("KV transfer: a pull from %s ended early: %s", _peer(writer), type(exc).__name__)
        finally:
            self._open -= 1
            writer.close()

    async def _pull(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if await reader.readexactly(len(MAGIC)) != MAGIC:
            raise WireError("not a KV-transfer client")
        ask = await read_frame(reader)
        hold_id, run = ask.get("hold"), _run(ask.get("first"), ask.get("count"))
        if not (isinstance(hold_id, str) and len(hold_id) <= MAX_HOLD_ID_CHARS) or run is None:
            writer.write(frame({"ok": False, "reason": "bad_request"}))
            await writer.drain()
            return
        first, count = run
        held = self.held.take(hold_id)
        if held is None:
            writer.write(frame({"ok": False, "reason": "gone"}))
            await writer.drain()
            return
        try:
            await self._send(writer, hold_id, held, first, count)
        finally:
            self.held.sent(hold_id)

    async def _send(
        self, writer: asyncio.StreamWriter, hold_id: str, held: Held, first: int, count: int
    ) -> None:
        if count == 0:  # a release: the decode pod holds the whole prefix already
            writer.write(frame({"ok": True, "epoch": held.epoch, "count": 0}))
            await writer.drain()
            return
        if first + count > len(held.keys):
            writer.write(frame({"ok": False, "reason": "gone"}))
            await writer.drain()
            return
        if held.ready is not None:  # the copy off the GPU is on a side stream: wait for it off the loop
            await asyncio.to_thread(held.ready.synchronize)
        blocks = held.data[first : first + count]
        header = {
            "ok": True,
            "epoch": held.epoch,
            "dtype": DTYPE_NAMES[blocks.dtype],
            "block_shape": list(blocks.shape[1:]),
            "count": count,
        }
        writer.write(frame(header))
        payload = as_bytes(blocks)
        # In pieces: the transport copies what the socket does not take at once, and a whole context's KV
        # queued at once would be a second copy of it per pull.
        for start in range(0, payload.nbytes, SEND_CHUNK_BYTES):
            writer.write(payload[start : start + SEND_CHUNK_BYTES])
            await writer.drain()
        # After the last byte: a reset of the hold's scope during the send closes it with a newer epoch.
        writer.write(frame({"epoch": self.held.closing_epoch(hold_id, held)}))
        await writer.drain()
        self.on_sent(count, payload.nbytes)


def _run(first: object, count: object) -> tuple[int, int] | None:
    """A run of blocks as asked: its first index and length, plain integers (JSON true is no number)."""
    if any(not isinstance(v, int) or isinstance(v, bool) for v in (first, count)):
        return None
    assert isinstance(first, int) and isinstance(count, int)
    return (first, count) if first >= 0 and count >= 0 else None


def _peer(writer: asyncio.StreamWriter) -> str:
    peer = writer.get_extra_info("peername")
    return f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else "?"
