"""Which pod rank holds which prefix block, as the pods' KV events say.

Entries are kept per holder: a (pod name, data-parallel rank) pair in the router, since each rank of a
data-parallel pod has its own KV cache and its own event stream (any hashable names one). A holder's entry
is exactly the set of block keys its engine has indexed, kept by applying its events in sequence order
(stored adds, removed drops, all-cleared empties). When events were lost and cannot be replayed, the pod's
entry is emptied and rebuilt from the events that follow: from then on it holds a subset of the truth, so
the router may under-predict a hit but never predicts one that is not there.

What a pod sends is bounded here, whatever it sends:
- a block hash is kept only if it is a 32-byte key (kvpilot's, `block_keys.py`) or vLLM's 64-bit integer
  form of one; anything else is skipped (it can name no block the router would look up, so skipping it
  loses nothing);
- a holder's entry never holds more keys than the rank's pool has blocks (`set_capacity`, from the pod's
  advertised `blocks_total`, at most `MAX_BLOCKS_PER_HOLDER`): a stream that would go past it no longer
  matches any pool, so the entry is emptied and rebuilt from the events that follow.

Expected blocks: a request the router has just sent computes its prompt's blocks there, but their
`BlockStored` events come only after that prefill. Until then a second request with the same prefix would
be scored as a miss everywhere and could land on another pod (or rank), which then computes the prefix too.
So the policy notes what it sent where (`expect_keys`), and matching may count those keys as well
(`matched_keys(..., expected=True)`) for `EXPECTED_TTL_S` or until the pod's events store, remove or clear
them. (`expect` and `matched_blocks` take block hashes as events carry them; the policy converts a
request's once, `index_keys`, and looks them up in every rank.) Expected keys only steer the choice: the
prediction reported against the pod's `cached_tokens` counts the keys the pod's events confirmed. A
data-parallel daemon's own rank choice remembers what it sent in the same way, so this is what lets the
router's exact choice of rank do at least as well.

Keys: each is kept as the integer of its last 8 bytes in a per-holder set, which is what vLLM's events
carry by default (`VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES`: the digest's last 8 bytes, big-endian), so a
kvpilot pod's 32-byte keys and a vLLM pod's integers meet a request's keys in one form (about 70-100 B
per key with CPython's set and int layouts; `bench/index_memory.py` measures it). Within one holder's
at most 2M keys, a 64-bit accidental collision has odds of about 1 in 10**13 per lookup, and a collision
could only mis-predict a cache hit, never change what a pod computes.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Hashable, Iterable, Sequence
from typing import TypeVar

from kvpilot.kv.block_keys import truncated
from kvpilot.kv.events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch

log = logging.getLogger(__name__)

Holder = Hashable  # (pod name, rank) in the router
H = TypeVar("H", bound=Hashable)  # a caller's own holder type
HASH_BYTES = 32  # a block key: a sha256 digest
KEY_LIMIT = 1 << 64  # vLLM's integer form of a key: its last 8 bytes, unsigned
# Blocks one holder may hold whatever its pod advertises: a rank with 2M blocks of 16 tokens caches 32M
# tokens, far beyond any one accelerator's KV memory today; it bounds a lying pod at ~230 MB.
MAX_BLOCKS_PER_HOLDER = 1 << 21
# How long a key sent to a holder counts as expected there: past the longest prefill plus event delivery
# that a 2-core CPU pod shows (a 4k-token prompt takes ~12 s); on an accelerator the events come far sooner
# and confirm the key before. A request that never computed its prefix misleads the choice until then.
EXPECTED_TTL_S = 30.0
# Expected keys kept per holder, the oldest dropped first: the prompts of the requests most recently sent
# there (256 prompts of 1k tokens in 16-token blocks).
MAX_EXPECTED_PER_HOLDER = 1 << 14


def index_key(block_hash: object) -> int | None:
    """The index's key for a block hash: a 32-byte key's last 8 bytes as an integer, or vLLM's integer of
    them as it is; None for anything else."""
    if type(block_hash) is bytes and len(block_hash) == HASH_BYTES:
        return truncated(block_hash)
    if type(block_hash) is int and 0 <= block_hash < KEY_LIMIT:
        return block_hash
    return None


def index_keys(hashes: Iterable[object]) -> list[int]:
    """The index's keys of a prompt's block hashes, up to the first of the wrong form (no holder has it,
    nor any block after it: a prefix stops at its first miss)."""
    keys = []
    for h in hashes:
        k = index_key(h)
        if k is None:
            break
        keys.append(k)
    return keys


def _drop_expired(expected: OrderedDict[int, float], now: float) -> None:
    """Drop a holder's expected keys whose time is past: they come first (PrefixIndex._expected)."""
    while expected:
        until = next(iter(expected.values()))
        if until > now:
            return
        expected.popitem(last=False)


class PrefixIndex:
    def __init__(self) -> None:
        self._blocks: dict[Holder, set[int]] = {}  # holder -> keys it holds
        self._capacity: dict[Holder, int] = {}  # holder -> most keys it can hold (its pool's blocks)
        self._sized: set[Holder] = set()  # holders whose pool size the pod published (room() knows it)
        self._clears: dict[Holder, int] = {}  # holder -> AllBlocksCleared events applied so far
        self._distrusted: set[Holder] = set()  # holders whose entries stay empty until their next clear
        self._refused: set[Holder] = set()  # holders already warned about for hashes of the wrong form
        self._cleared = asyncio.Event()  # set (and replaced) whenever a holder reports AllBlocksCleared
        # holder -> key -> when it stops being expected, in that order (each key is expected for the same
        # EXPECTED_TTL_S from when it was last sent, and moved to the end then): expired ones are dropped
        # from the front, so a holder's count of expected keys is their number, never a scan
        self._expected: dict[Holder, OrderedDict[int, float]] = {}

    # ---- updates -------------------------------------------------------------------------------
    def set_capacity(self, holder: Holder, blocks: int | None) -> None:
        """The most blocks `holder` can hold: its pool's size (None: not known, the router's ceiling)."""
        cap = MAX_BLOCKS_PER_HOLDER if blocks is None else max(1, min(blocks, MAX_BLOCKS_PER_HOLDER))
        self._capacity[holder] = cap
        if blocks is None:
            self._sized.discard(holder)
        else:
            self._sized.add(holder)
        if self.num_blocks(holder) > cap:
            self.clear(holder)

    def apply(self, holder: Holder, batch: EventBatch) -> None:
        for ev in batch.events:
            if holder in self._distrusted and not isinstance(ev, AllBlocksCleared):
                continue
            if isinstance(ev, BlockStored):
                self.store(holder, ev.block_hashes)
            elif isinstance(ev, BlockRemoved):
                self.remove(holder, ev.block_hashes)
            elif isinstance(ev, AllBlocksCleared):
                self.clear(holder)
                self._distrusted.discard(holder)
                self._clears[holder] = self._clears.get(holder, 0) + 1
                self._cleared.set()
                self._cleared = asyncio.Event()

    def store(self, holder: Holder, hashes: Iterable[object]) -> None:
        held = self._blocks.setdefault(holder, set())
        cap = self._capacity.get(holder, MAX_BLOCKS_PER_HOLDER)
        expected: dict[int, float] = self._expected.get(holder) or {}
        for h in hashes:
            k = index_key(h)
            if k is None:
                self._refuse(holder, h)
                continue
            expected.pop(k, None)  # confirmed: the pod's events speak for it from now on
            if len(held) >= cap and k not in held:
                # More blocks than the pool has: events were lost or the pod is lying. Start over.
                log.warning("%s: more than its %d blocks indexed; emptying its entry", holder, cap)
                held.clear()
            held.add(k)

    def remove(self, holder: Holder, hashes: Iterable[object]) -> None:
        held = self._blocks.get(holder) or set()
        expected: dict[int, float] = self._expected.get(holder) or {}
        if not held and not expected:
            return
        for h in hashes:
            k = index_key(h)
            if k is not None:
                held.discard(k)  # a malformed hash was never stored
                expected.pop(k, None)

    def clear(self, holder: Holder) -> None:
        self._blocks.pop(holder, None)
        self._expected.pop(holder, None)

    def expect(self, holder: Holder, hashes: Iterable[object]) -> None:
        """`holder` was just sent a prompt with these block hashes: count them as expected there until its
        events confirm or drop them, or for EXPECTED_TTL_S. A hash of the wrong form ends the prompt there
        (`index_keys`): no block after it could be matched."""
        self.expect_keys(holder, index_keys(hashes))

    def expect_keys(self, holder: Holder, keys: Iterable[int]) -> None:
        """`expect` for hashes already made the index's keys (`index_keys`)."""
        if holder in self._distrusted:
            return  # a reset on its way: nothing sent before it counts
        held = self._blocks.get(holder) or ()
        expected = self._expected.get(holder)
        if expected is None:
            expected = self._expected[holder] = OrderedDict()
        now = time.monotonic()
        _drop_expired(expected, now)
        until = now + EXPECTED_TTL_S
        for k in keys:
            if k in held:
                continue
            expected[k] = until
            expected.move_to_end(k)  # last: the newest are kept when the bound drops the oldest
        while len(expected) > MAX_EXPECTED_PER_HOLDER:
            expected.popitem(last=False)

    def forget(self, holder: Holder) -> None:
        """Drop everything about a holder that left the fleet."""
        self.clear(holder)
        self._capacity.pop(holder, None)
        self._sized.discard(holder)
        self._distrusted.discard(holder)
        self._refused.discard(holder)

    def distrust(self, holder: Holder) -> None:
        """Empty the holder's entries and ignore what it stores until it reports AllBlocksCleared: for a
        pod that was reset but whose clear event has not arrived (events sent before the reset may still
        be on their way)."""
        self.clear(holder)
        self._distrusted.add(holder)

    def _refuse(self, holder: Holder, h: object) -> None:
        if holder not in self._refused:  # once per holder: a broken pod would send many
            self._refused.add(holder)
            log.warning(
                "%s: skipped a block hash that is neither a %d-byte key nor a 64-bit integer (%s); others may follow",
                holder,
                HASH_BYTES,
                type(h).__name__,
            )

    # ---- queries -------------------------------------------------------------------------------
    def num_blocks(self, holder: Holder) -> int:
        return len(self._blocks.get(holder, ()))

    def room(self, holder: Holder) -> int | None:
        """Blocks the holder can still take without evicting any: its pool less what it holds and what it
        was just sent (at least 0); None when its pool's size is not known."""
        cap = self._capacity.get(holder)
        if cap is None or holder not in self._sized:
            return None
        expected = self._expected.get(holder)
        if expected:
            _drop_expired(expected, time.monotonic())
        return max(cap - self.num_blocks(holder) - len(expected or ()), 0)

    def fill(self, holder: Holder) -> float | None:
        """The share of the holder's pool that is taken (`room` less from the whole, 0 to 1); None when its
        pool's size is not known."""
        room = self.room(holder)
        return None if room is None else 1 - room / self._capacity[holder]

    def blocks_of(self, holders: Iterable[Holder]) -> int:
        """Blocks indexed for a pod: its ranks' entries together."""
        return sum(self.num_blocks(h) for h in holders)

    def clears(self, holder: Holder) -> int:
        return self._clears.get(holder, 0)

    def matched_blocks(
        self, hashes: Sequence[bytes], holders: Iterable[H], expected: bool = False
    ) -> dict[H, int]:
        """For each holder, how many leading block hashes it holds without a gap (the engine stops at its
        first miss too); with `expected`, keys it was sent and has not confirmed yet count as held."""
        return self.matched_keys(index_keys(hashes), holders, expected)

    def matched_keys(self, keys: Sequence[int], holders: Iterable[H], expected: bool = False) -> dict[H, int]:
        """`matched_blocks` for hashes already made the index's keys (`index_keys`): a router keys a
        request's prompt once, and looks it up for each of its pods' ranks."""
        return {
            h: held_or_sent if expected else held
            for h, (held, held_or_sent) in self.matches(keys, holders).items()
        }

    def matches(self, keys: Sequence[int], holders: Iterable[H]) -> dict[H, tuple[int, int]]:
        """For each holder, both counts at once: the leading keys it holds, and those it holds or was sent
        and has not confirmed (`matched_keys` without and with `expected`; the policy scores by the
        second and reports the first)."""
        out: dict[H, tuple[int, int]] = {}
        now = time.monotonic()
        n = len(keys)
        for h in holders:
            held = self._blocks.get(h) or ()
            held_n = 0
            while held_n < n and keys[held_n] in held:
                held_n += 1
            sent = self._expected.get(h)
            either_n = held_n
            if sent:
                while either_n < n and (keys[either_n] in held or sent.get(keys[either_n], 0.0) > now):
                    either_n += 1
            out[h] = (held_n, either_n)
        return out

    async def wait_cleared(self, holder: Holder, after: int, timeout: float) -> bool:
        """True once `holder` has reported more than `after` AllBlocksCleared events (within `timeout`)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while self.clears(holder) <= after:
            remaining = deadline - loop.time()
            if remaining <= 0:
                return False
            try:
                await asyncio.wait_for(self._cleared.wait(), remaining)
            except TimeoutError:
                return False
        return True
