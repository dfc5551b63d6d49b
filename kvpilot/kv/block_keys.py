"""Prefix-cache keys for full KV blocks, in the schemes a daemon can hash with (`--prefix-caching-hash-algo`).

A block's key hashes (parent key, the block's token ids, extra keys). Chaining the parent makes the key
name the whole prefix, not just the block's own tokens; a cryptographic hash makes it collision-resistant
and the same in every process (Python's hash() is salted per process), so keys are published as KV events
and a router (`kvpilot.router`, vllm-router, llm-d's indexer) computes the very same keys from a request's
tokens. Extra keys (a tenant's `cache_salt`, the weight version) enter the first block only, which is
enough: every later key chains from it, so two salts, or two weight versions, never share any block. The
weights a daemon loaded without a name (no `--weight-version`, no update yet) add nothing, so a router
that knows no versions still computes their keys.

The schemes, by their `--prefix-caching-hash-algo` names:
- `sha256_cbor` (the default): vLLM's own keys (`vllm.v1.core.kv_cache_utils.hash_block_tokens` with
  `vllm.utils.hashing.sha256_cbor`, vLLM 0.32): sha256 of the canonical CBOR of the tuple (parent, token
  ids, extra keys or None), the first block's parent being the hash of the seed string. It is the one
  scheme consumers outside Python can recompute (llm-d's precise prefix-cache scorer runs vLLM with it),
  so a kvpilot daemon's events mean to them what a vLLM pod's do.
- `sha256`: vLLM's default (the same tuple, pickled with the highest protocol): what a vLLM pod started
  without the flag hashes with, so the router can compute a plain vLLM fleet's keys.
- `kvpilot`: kvpilot's earlier scheme (sha256 over the parent, the token ids as packed int32 and the extra
  bytes), for fleets whose routers predate the flag.

The seed is vLLM's: `PYTHONHASHSEED` when set, else "vllm-none-hash", so a daemon and a vLLM pod started
the same way agree. Extra keys are tagged as vLLM tags them (`("cache_salt", salt)`), so no salt can
equal another kind of key; the weight version, which vLLM has no notion of, is tagged kvpilot's way
(`("weight_version", v)`) and only present once weights are named. A LoRA adapter's blocks carry
`("lora", name, digest)`: its own tag, so no `cache_salt` can equal an adapter's name (vLLM 44701), and the
digest of its files, so an adapter loaded again with new weights never matches its old blocks (vLLM 42125).
vLLM 0.33 keys `("lora", name, path)` into every block instead: an in-place reload keeps the path, so the
path cannot tell the weights apart, and adapter keys are kvpilot's own (a consumer computing vLLM's keys
finds a kvpilot daemon's base-model blocks, not its adapters').
"""

from __future__ import annotations

import functools
import hashlib
import os
import pickle
import struct
from dataclasses import dataclass
from typing import NewType, cast

import cbor2

BlockHash = NewType("BlockHash", bytes)


@dataclass(frozen=True, slots=True)
class LoRAKey:
    """A LoRA adapter's identity as its blocks' keys carry it: the daemon's (daemon/engine/weights/lora.py), and
    the router's for a pod that names it in its /health."""

    name: str
    digest: str  # of its files: a new version of an adapter shares no block with the old


HASH_ALGOS = ("sha256_cbor", "sha256", "kvpilot")
DEFAULT_HASH_ALGO = "sha256_cbor"
DEFAULT_SEED = "vllm-none-hash"  # vLLM's seed for its sha256 schemes when PYTHONHASHSEED is unset
MAX_SEED_CHARS = 256  # a seed read from a pod's /kv_events is bounded like any other string from it

_KVPILOT_ROOT = b"kvpilot-prefix-v1"
KVPILOT_WIRE_NAME = "sha256-chained/kvpilot-prefix-v1"  # the `kvpilot` scheme as daemons always named it


@dataclass(frozen=True, slots=True)
class KeyScheme:
    """How one daemon keys its blocks: hashable, so a router groups pods by it."""

    algo: str  # one of HASH_ALGOS
    seed: str = DEFAULT_SEED  # only the vLLM schemes use it

    def __post_init__(self) -> None:
        if self.algo not in HASH_ALGOS:
            raise ValueError(f"prefix-caching hash algo {self.algo!r}: one of {', '.join(HASH_ALGOS)}")
        if len(self.seed) > MAX_SEED_CHARS:
            raise ValueError(f"a hash seed has at most {MAX_SEED_CHARS} characters")
        try:  # it is hashed as text: a lone surrogate (a pod's JSON may carry one) has no encoding
            self.seed.encode("utf-8")
        except UnicodeEncodeError:
            raise ValueError("a hash seed must be valid Unicode text") from None

    @property
    def _root(self) -> BlockHash:
        if self.algo == "kvpilot":
            return BlockHash(_KVPILOT_ROOT)
        return _roots(self.algo, self.seed)

    def first_extra(
        self, cache_salt: str | None, weight_version: str | None, lora: LoRAKey | None = None
    ) -> object:
        """What the first block hashes besides its tokens (None: nothing) for a request's `cache_salt` on
        weights named `weight_version` (None: unnamed), under the adapter `lora` (None: the base model)."""
        if self.algo == "kvpilot":
            return _kvpilot_extra(cache_salt, weight_version, lora) or None
        extra: list[tuple[str | bytes, ...]] = []
        if lora is not None:
            extra.append(("lora", _text(lora.name), lora.digest))
        if cache_salt:
            extra.append(("cache_salt", _text(cache_salt)))
        if weight_version is not None:
            extra.append(("weight_version", _text(weight_version)))
        return tuple(extra) or None

    def hash_block(
        self, parent: BlockHash | None, token_ids: list[int] | tuple[int, ...], extra: object
    ) -> BlockHash:
        tokens = tuple(token_ids)
        memo_key = (self.algo, self.seed, parent, tokens, extra)
        key = _MEMO.get(memo_key)
        if key is None:
            key = self._hash_block(parent if parent is not None else self._root, tokens, extra)
            _MEMO.put(memo_key, key)
        return key

    def _hash_block(self, parent: BlockHash, token_ids: tuple[int, ...], extra: object) -> BlockHash:
        if self.algo == "kvpilot":
            h = hashlib.sha256(parent)
            h.update(struct.pack(f"<{len(token_ids)}i", *token_ids))
            if extra:
                h.update(b"\x00extra\x00")
                h.update(cast(bytes, extra))  # first_extra's for this algo: _kvpilot_extra's bytes
            return BlockHash(h.digest())
        return BlockHash(hashlib.sha256(_serialize(self.algo, (parent, token_ids, extra))).digest())

    def extend(
        self, hashes: list[BlockHash], token_ids: list[int], block_size: int, first_extra: object
    ) -> None:
        """Append the keys of every newly full block of `token_ids` to `hashes` (each computed once)."""
        for i in range(len(hashes), len(token_ids) // block_size):
            parent = hashes[i - 1] if i > 0 else None
            chunk = token_ids[i * block_size : (i + 1) * block_size]
            hashes.append(self.hash_block(parent, chunk, first_extra if i == 0 else None))

    def describe(self) -> dict[str, str]:
        """How GET /kv_events names this scheme to consumers (`scheme_from_wire` reads it back)."""
        if self.algo == "kvpilot":
            return {"block_hash": KVPILOT_WIRE_NAME}
        return {"block_hash": self.algo, "hash_seed": self.seed}

    def prompt_hashes(
        self,
        token_ids: list[int],
        block_size: int,
        cache_salt: str | None = None,
        weight_version: str | None = None,
        lora: LoRAKey | None = None,
    ) -> list[BlockHash]:
        """The keys of every full block of `token_ids`, as the engine computes them for a request."""
        hashes: list[BlockHash] = []
        self.extend(hashes, token_ids, block_size, self.first_extra(cache_salt, weight_version, lora))
        return hashes


# (algo, seed, parent, the block's token ids, first_extra's value): what a block's key is computed from
_MemoKey = tuple[str, str, BlockHash | None, tuple[int, ...], object]


class _KeyMemo:
    """The keys of blocks hashed lately, by (algo, seed, parent, tokens, extra): a prefix many requests
    share (a system prompt, a few-shot preamble, an RL group's prompt, earlier turns of a chat) is hashed
    once, not once per request. Under load the hashing (a CBOR encoding and a sha256 per block) cost the
    router ~0.12 ms of a 1 KiB chat; a hit costs the tuple's hash and a lookup (bench/router_compare.py).

    Two generations of at most `max_bytes` each, so the memory is bounded by what the entries hold, not by
    their count (a block of a pod's 65,536 tokens, a salt of 4,096 characters), and no lock is needed: a
    lookup promotes an old entry, and a full young generation becomes the old one, the older dropped whole."""

    def __init__(self, max_bytes: int = 16 << 20) -> None:
        self.max_bytes = max_bytes
        self._young: dict[_MemoKey, BlockHash] = {}
        self._old: dict[_MemoKey, BlockHash] = {}
        self._young_bytes = 0

    def get(self, key: _MemoKey) -> BlockHash | None:
        hit = self._young.get(key)
        if hit is None:
            hit = self._old.get(key)
            if hit is not None:
                self.put(key, hit)
        return hit

    def put(self, key: _MemoKey, value: BlockHash) -> None:
        size = _entry_bytes(key)
        if self._young_bytes + size > self.max_bytes:
            self._old, self._young, self._young_bytes = self._young, {}, 0
        self._young[key] = value
        self._young_bytes += size

    def __len__(self) -> int:
        return len(self._young) + len(self._old)


# What an entry holds besides its key's bytes: the dict slot, the key tuple and the 32-byte value.
_ENTRY_OVERHEAD_BYTES = 200


def _entry_bytes(key: _MemoKey) -> int:
    """About what one memo entry holds: a pointer and an int per token (the key keeps the request's ints
    alive after it ends: 28 bytes each past 256), the seed and the first block's extra (a salt, a weight
    version, an adapter's name)."""
    _, seed, _, tokens, extra = key
    return _ENTRY_OVERHEAD_BYTES + len(seed) + 36 * len(tokens) + _extra_bytes(extra)


def _extra_bytes(extra: object) -> int:
    if isinstance(extra, (bytes, str)):
        return len(extra)
    if isinstance(extra, tuple):
        return sum(_extra_bytes(x) for x in extra) + 8 * len(extra)
    return 0  # None


_MEMO = _KeyMemo()


def _serialize(algo: str, value: object) -> bytes:
    if algo == "sha256_cbor":
        return cbor2.dumps(value, canonical=True)
    return pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)


@functools.lru_cache(maxsize=64)  # seeds come from pods: bounded, however many they name
def _roots(algo: str, seed: str) -> BlockHash:
    """vLLM's NONE_HASH: the seed string hashed by the scheme's own function."""
    return BlockHash(hashlib.sha256(_serialize(algo, seed)).digest())


def _text(value: str) -> str | bytes:
    """`value` as CBOR can encode it: a str with a lone surrogate (JSON allows "\\ud800") goes in as its
    surrogatepass bytes, which no text can equal, so hashing never raises mid-step."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return value.encode("utf-8", "surrogatepass")
    return value


def _kvpilot_extra(cache_salt: str | None, weight_version: str | None, lora: LoRAKey | None) -> bytes:
    # surrogatepass: any str the caller passed hashes, lone surrogates included, never raises mid-step
    key = cache_salt.encode("utf-8", "surrogatepass") if cache_salt else b""
    if weight_version is not None:
        key += b"\x00weights\x00" + weight_version.encode("utf-8", "surrogatepass")
    if lora is not None:
        # 0xFF starts it: no byte of UTF-8 (surrogatepass too) is 0xFF, so no salt or version can spell an
        # adapter's part, and the name's length keeps name and digest apart.
        name = lora.name.encode("utf-8", "surrogatepass")
        key += b"\xfflora" + len(name).to_bytes(4, "big") + name + lora.digest.encode()
    return key


def key_scheme(algo: str = DEFAULT_HASH_ALGO, seed: str | None = None) -> KeyScheme:
    """The scheme a daemon hashes with: `algo`, seeded as vLLM seeds it (`PYTHONHASHSEED`, else vLLM's
    fixed default) unless `seed` is given."""
    if seed is None:
        seed = os.environ.get("PYTHONHASHSEED")  # set but empty is a seed too, as vLLM reads it
        seed = DEFAULT_SEED if seed is None else seed
    return KeyScheme(algo, seed if algo != "kvpilot" else DEFAULT_SEED)


DEFAULT_KEYS = KeyScheme(DEFAULT_HASH_ALGO)  # the default algo, vLLM's default seed


def scheme_from_wire(block_hash: object, hash_seed: object) -> KeyScheme:
    """The scheme a pod's GET /kv_events names (ValueError if it names none kvpilot computes); a pod that
    names none is an older kvpilot daemon, which only had kvpilot's own keys."""
    if block_hash is None or block_hash == KVPILOT_WIRE_NAME:
        return KeyScheme("kvpilot")
    if block_hash not in HASH_ALGOS or block_hash == "kvpilot":
        raise ValueError(f"block_hash names no key scheme this router computes ({', '.join(HASH_ALGOS[:2])})")
    if hash_seed is None:
        return KeyScheme(block_hash)
    if not isinstance(hash_seed, str):
        raise ValueError("hash_seed must be a string")
    return KeyScheme(block_hash, hash_seed)


def truncated(key: bytes) -> int:
    """A key as vLLM's events carry it by default (`VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES`): its last 8
    bytes as an unsigned big-endian integer."""
    return int.from_bytes(key[-8:], "big")
