"""A prefill pod's held KV: each prompt a remote decode will pull, copied off the pool when its prefill
ended, kept under a random id until one pull takes it, its time runs out, the bytes are needed for a newer
one, or a reset drops it.

Held KV lives off the pool (host memory; on a GPU pinned memory filled on a side stream), so a hold never
pins pool blocks: requests never wait for a decode pod to pull, and a full reset drops holds in O(1) (a map
swapped for an empty one) without waiting for a pull in flight. A hold being sent when a reset of its scope
lands is marked crossed: the sender closes the send with the producer's current epoch instead of the hold's
own (every reset moves the epoch on), and the decode side refuses what crossed a reset. A reset of another
scope leaves holds and sends of this one whole.

The engine thread makes holds and resets; the transfer server's event loop takes them: one lock orders them.
"""

from __future__ import annotations

import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvpilot.daemon.engine.kv.cache_scope import CacheScope
from kvpilot.kv.block_keys import BlockHash


@dataclass(frozen=True, slots=True)
class Held:
    """One prompt's full blocks: `data` is [blocks, layers, K/V, block_size, kv_heads, head_dim]."""

    keys: tuple[BlockHash, ...]
    data: torch.Tensor
    ready: torch.cuda.Event | None  # set once the copy off the GPU has landed; None on the CPU
    scope: CacheScope
    epoch: int
    expires: float  # time.monotonic()

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()


@dataclass(frozen=True, slots=True)
class HeldSummary:
    """What a prefill's reply tells the decode side about its hold (None of it when nothing is held)."""

    keys: tuple[BlockHash, ...]
    epoch: int


@dataclass(frozen=True, slots=True)
class HeldStats:
    transfers: int
    blocks: int
    bytes: int
    epoch: int
    dropped: dict[str, int]  # holds dropped unpulled, by why: expired, full, reset


class HeldKV:
    def __init__(self, timeout_s: float, max_bytes: int) -> None:
        self.timeout_s, self.max_bytes = timeout_s, max_bytes
        self._lock = threading.Lock()
        self._held: OrderedDict[str, Held] = OrderedDict()  # oldest first
        self._sending: dict[str, Held] = {}  # taken by a pull whose send has not ended
        self._crossed: set[str] = set()  # of those, the ones a reset of their scope came during
        self._bytes = 0  # of the holds waiting and those being sent
        self.epoch = 0
        self._dropped: Counter[str] = Counter()

    def hold(
        self,
        hold_id: str,
        keys: tuple[BlockHash, ...],
        data: torch.Tensor,
        ready: torch.cuda.Event | None,
        scope: CacheScope,
    ) -> HeldSummary:
        with self._lock:
            held = Held(keys, data, ready, scope, self.epoch, time.monotonic() + self.timeout_s)
            if held.nbytes > self.max_bytes:  # one prompt larger than the whole budget: never held
                self._dropped["full"] += 1
                return HeldSummary((), self.epoch)
            self._expire(time.monotonic())
            while self._held and self._bytes + held.nbytes > self.max_bytes:
                self._pop(next(iter(self._held)), "full")
            self._held[hold_id] = held
            self._bytes += held.nbytes
            return HeldSummary(keys, self.epoch)

    def take(self, hold_id: str) -> Held | None:
        """The hold, for its one pull (no other pull finds it again); None when there is none (never made,
        pulled, expired, dropped). Its bytes count until `sent`."""
        with self._lock:
            self._expire(time.monotonic())
            held = self._held.pop(hold_id, None)
            if held is not None:
                self._sending[hold_id] = held
            return held

    def sent(self, hold_id: str) -> None:
        """The send of a taken hold ended, whole or not: its bytes are free."""
        with self._lock:
            held = self._sending.pop(hold_id, None)
            if held is not None:
                self._bytes -= held.nbytes
            self._crossed.discard(hold_id)

    def drop(self, match: Callable[[CacheScope], bool] | None = None) -> int:
        """A reset: every hold (or those of the scopes `match` names) goes, the epoch moves on, and a send of
        one of them under way is marked crossed (refused at its end). How many waiting holds went."""
        with self._lock:
            self.epoch += 1
            self._crossed.update(h for h, held in self._sending.items() if match is None or match(held.scope))
            if match is None:
                n = len(self._held)
                self._held = OrderedDict()
                self._bytes = sum(held.nbytes for held in self._sending.values())
                self._dropped["reset"] += n
                return n
            gone = [h for h, held in self._held.items() if match(held.scope)]
            for h in gone:
                self._pop(h, "reset")
            return len(gone)

    def stats(self) -> HeldStats:
        with self._lock:
            self._expire(time.monotonic())
            blocks = sum(len(h.keys) for h in self._held.values())
            return HeldStats(len(self._held), blocks, self._bytes, self.epoch, dict(self._dropped))

    def closing_epoch(self, hold_id: str, held: Held) -> int:
        """What a send of a taken hold closes with, after its last byte: the hold's own epoch, or, when a
        reset of its scope has come since it was taken, the producer's current one (newer: every reset moves
        it on)."""
        with self._lock:
            return self.epoch if hold_id in self._crossed else held.epoch

    def _expire(self, now: float) -> None:
        # holds expire in the order they were made (one timeout for all): the oldest first
        while self._held and (first := next(iter(self._held))) and self._held[first].expires <= now:
            self._pop(first, "expired")

    def _pop(self, hold_id: str, why: str) -> None:
        self._bytes -= self._held.pop(hold_id).nbytes
        self._dropped[why] += 1
