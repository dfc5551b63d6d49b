"""The decode side of a transfer: pull a run of held blocks from a prefill pod, bounded in bytes and time.

The reply must describe exactly the blocks asked for, in this pod's own KV dtype and block shape (a pod of
another model or dtype is refused, not reinterpreted), and its closing epoch must equal the one the prefill's
reply gave: a prefill pod reset after it made the hold sent KV from before its reset, which is refused.
Whatever goes wrong is a `PullFailed` with a reason (a metric label); the caller computes the prompt instead.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import torch

from kvpilot.daemon.kv_transfer.wire import DTYPES, MAGIC, Connection, WireError, as_bytes, frame

# kvpilot_kv_transfer_failures_total's reasons, decode side (the engine adds local_reset and gap).
REASONS = ("gone", "remote_reset", "timeout", "unreachable", "protocol", "incompatible")


class PullFailed(Exception):
    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


@dataclass(frozen=True, slots=True)
class PullRequest:
    host: str
    port: int
    hold_id: str
    first: int  # the first held block wanted
    count: int
    epoch: int  # the prefill pod's epoch when it made the hold (its reply's remote_epoch)


async def pull(
    ask: PullRequest, block_shape: tuple[int, ...], dtype: torch.dtype, timeout_s: float, pinned: bool = False
) -> torch.Tensor:
    """The blocks, [count, *block_shape] in host memory (`pinned`: page-locked, for a CUDA pool to copy from
    on its stream); PullFailed when they cannot be had whole."""
    try:
        return await asyncio.wait_for(_pull(ask, block_shape, dtype, pinned), timeout_s)
    except TimeoutError:
        raise PullFailed("timeout", f"no whole reply within {timeout_s:g} s") from None
    except OSError as exc:
        raise PullFailed("unreachable", f"{ask.host}:{ask.port}: {exc.strerror or exc}") from None
    except (WireError, asyncio.IncompleteReadError) as exc:
        raise PullFailed("protocol", str(exc) or type(exc).__name__) from None
    except ValueError as exc:  # the resolver's UnicodeError for a name it cannot encode
        raise PullFailed("unreachable", f"{ask.host}: {exc}") from None


async def release(host: str, port: int, hold_id: str, timeout_s: float) -> None:
    """Let the prefill pod drop a hold this pod needs nothing of (its pool holds the whole prefix), rather
    than keep it until its timeout. Best effort: a failure leaves the hold to expire."""
    try:
        async with asyncio.timeout(timeout_s):
            conn = await Connection.open(host, port)
            try:
                await conn.send(MAGIC + frame({"hold": hold_id, "first": 0, "count": 0}))
                await conn.read_frame()
            finally:
                conn.close()
    except (OSError, TimeoutError, ValueError, WireError, asyncio.IncompleteReadError):
        pass


async def _pull(
    ask: PullRequest, block_shape: tuple[int, ...], dtype: torch.dtype, pinned: bool
) -> torch.Tensor:
    conn = await Connection.open(ask.host, ask.port)
    try:
        await conn.send(MAGIC + frame({"hold": ask.hold_id, "first": ask.first, "count": ask.count}))
        head = await conn.read_frame()
        if head.get("ok") is not True:
            reason = head.get("reason")
            raise PullFailed("gone" if reason == "gone" else "protocol", f"the prefill pod said {reason!r}")
        if (
            DTYPES.get(str(head.get("dtype"))) != dtype
            or head.get("block_shape") != list(block_shape)
            or head.get("count") != ask.count
        ):
            raise PullFailed(
                "incompatible",
                f"blocks of {head.get('dtype')} {head.get('block_shape')} x {head.get('count')}, this pod "
                f"needs {dtype} {list(block_shape)} x {ask.count}",
            )
        if head.get("epoch") != ask.epoch:
            raise PullFailed("remote_reset", "the prefill pod reset after it held these blocks")
        data = torch.empty((ask.count, *block_shape), dtype=dtype, pin_memory=pinned)
        await conn.receive_into(as_bytes(data))
        tail = await conn.read_frame()
        if tail.get("epoch") != ask.epoch:
            raise PullFailed("remote_reset", "the prefill pod reset while it sent these blocks")
        return data
    finally:
        conn.close()
