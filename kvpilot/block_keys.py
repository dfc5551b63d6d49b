"""Prefix-cache keys for full KV blocks.

A block's key is sha256(parent key | token ids | extra keys). Chaining the parent makes the key name
the whole prefix, not just the block's own tokens; sha256 makes it collision-resistant and the same in
every process (Python's hash() is salted per process), so keys are published as KV events and the
fleet router (`kvpilot.router`) computes the very same keys from a request's tokens with this module.
Extra keys (e.g. a tenant's `cache_salt`, the weight version) enter the first block only, which is
enough: every later key chains from it, so two salts, or two weight versions, never share any block.
The weights a daemon loaded without a name (no `--weight-version`, no update yet) add nothing, so a
router that knows no versions still computes their keys.
"""

from __future__ import annotations

import hashlib
import struct
from typing import NewType

BlockHash = NewType("BlockHash", bytes)

_ROOT = b"kvpilot-prefix-v1"


def hash_block(
    parent: BlockHash | None, token_ids: list[int] | tuple[int, ...], extra: bytes = b""
) -> BlockHash:
    h = hashlib.sha256()
    h.update(parent if parent is not None else _ROOT)
    h.update(struct.pack(f"<{len(token_ids)}i", *token_ids))
    if extra:
        h.update(b"\x00extra\x00")
        h.update(extra)
    return BlockHash(h.digest())


def salt_key(cache_salt: str | None, weight_version: str | None = None) -> bytes:
    """The extra key a request's `cache_salt` and the weight version add to its first block (empty
    without either)."""
    # surrogatepass: any str the caller passed hashes, lone surrogates included, never raises mid-step
    key = cache_salt.encode("utf-8", "surrogatepass") if cache_salt else b""
    if weight_version is not None:
        key += b"\x00weights\x00" + weight_version.encode("utf-8", "surrogatepass")
    return key


def prompt_block_hashes(
    token_ids: list[int], block_size: int, cache_salt: str | None = None, weight_version: str | None = None
) -> list[BlockHash]:
    """The keys of every full block of `token_ids`, as the engine computes them for a request."""
    hashes: list[BlockHash] = []
    extend_block_hashes(hashes, token_ids, block_size, salt_key(cache_salt, weight_version))
    return hashes


def extend_block_hashes(
    hashes: list[BlockHash], token_ids: list[int], block_size: int, extra: bytes = b""
) -> None:
    """Append the keys of every newly full block of `token_ids` to `hashes` (computed once per block)."""
    num_full = len(token_ids) // block_size
    for i in range(len(hashes), num_full):
        parent = hashes[i - 1] if i > 0 else None
        chunk = token_ids[i * block_size : (i + 1) * block_size]
        hashes.append(hash_block(parent, chunk, extra if i == 0 else b""))
