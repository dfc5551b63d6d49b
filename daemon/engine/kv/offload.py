"""The second KV tier: blocks the pool evicts stay in host memory and, past that, on disk; a prefix that
misses the pool but hits here is copied back into the pool instead of being computed again.

Each tier is an LRU map from the pool's own block key (`block_keys.py`) to the block's K and V for every
layer, bounded in bytes. The tiers and the pool never hold one key twice: a block copied back leaves its
tier, a key the pool indexes again is dropped from the tiers, and a block the host tier evicts moves to the
disk tier. A reset empties every tier in O(1): the host tier swaps its map for an empty one (as the pool
does), the disk tier starts a new generation directory, and a disk write still in flight from before the
reset lands in the old generation, which is never read again (`DiskTier`). A scoped reset (one adapter,
salt or weight version: `cache_scope.py`) drops that scope's blocks from the host tier, O(blocks held
there), and from the disk tier, whose directory per scope it renames away (O(1) on disk, O(blocks held)
in its index).

Copies: the block's data is gathered off the pool before the step's forward pass can overwrite it (on a
GPU, into pinned host memory on a side stream the step does not wait for; on the CPU the gather is that
copy). Disk writes run on a worker thread; a step never waits for one.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import shutil
import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path

import torch

from kvpilot.daemon.engine.kv.cache_scope import CacheScope, scope_dir_name, scope_from_record, scope_record
from kvpilot.daemon.engine.outputs import TierStats
from kvpilot.kv.block_keys import BlockHash

log = logging.getLogger(__name__)

HOST, DISK = "host", "disk"
# The tiers' names in KV events, as vLLM names the media of its offloading connector.
MEDIUM = {HOST: "CPU", DISK: "STORAGE"}
MANIFEST = "manifest.json"
MANIFEST_FORMAT = "kvpilot-kv-offload-v2"  # v2: a directory per cache scope in each generation
SCOPE_FILE = "scope.json"
# A scope.json holds a weight version, an adapter name and digest and a salt, each bounded where the daemon
# takes it (well under 8 KiB together); a bigger one is not the daemon's and is removed unread.
MAX_SCOPE_FILE_BYTES = 64 << 10
# Host memory the disk writer may hold in queued blocks; past it a block the host tier evicts is dropped
# instead of spilled (a slow disk must not grow the daemon's memory without bound).
MAX_PENDING_WRITE_BYTES = 256 << 20


@dataclass(slots=True)
class HostBlock:
    """One block's K and V of every layer, [layers, 2, block_size, kv_heads, head_dim], in host memory.
    `ready` (a CUDA event) is set once the copy off the GPU has landed; None on the CPU."""

    data: torch.Tensor
    ready: torch.cuda.Event | None = None
    scope: CacheScope | None = None  # what it was computed under, for scoped resets

    def wait(self) -> None:
        if self.ready is not None:
            self.ready.synchronize()


class HostTier:
    name = HOST

    def __init__(self, capacity_bytes: int, block_bytes: int) -> None:
        self.capacity_bytes = capacity_bytes
        self.block_bytes = block_bytes
        self._blocks: OrderedDict[BlockHash, HostBlock] = OrderedDict()
        self.hit_tokens = self.stored_blocks = self.loaded_blocks = 0

    def __len__(self) -> int:
        return len(self._blocks)

    def get(self, key: BlockHash) -> HostBlock | None:
        return self._blocks.get(key)

    def discard(self, key: BlockHash) -> bool:
        return self._blocks.pop(key, None) is not None

    def put(self, key: BlockHash, block: HostBlock) -> list[tuple[BlockHash, HostBlock]]:
        """Store a block; returns the least recently stored ones pushed out to stay within capacity."""
        self._blocks[key] = block
        self._blocks.move_to_end(key)
        self.stored_blocks += 1
        out = []
        while len(self._blocks) * self.block_bytes > self.capacity_bytes:
            out.append(self._blocks.popitem(last=False))
        return out

    def reset(self) -> int:
        n = len(self._blocks)
        self._blocks = OrderedDict()  # the old map and its tensors go with the last reference
        return n

    def reset_scopes(self, match: Callable[[CacheScope], bool]) -> list[BlockHash]:
        """Drop the blocks of the scopes `match` names; returns their keys."""
        gone = [k for k, b in self._blocks.items() if b.scope is not None and match(b.scope)]
        for k in gone:
            del self._blocks[k]
        return gone

    def stats(self) -> TierStats:
        return TierStats(
            HOST,
            len(self._blocks),
            len(self._blocks) * self.block_bytes,
            self.capacity_bytes,
            self.hit_tokens,
            self.stored_blocks,
            self.loaded_blocks,
        )


@dataclass(frozen=True, slots=True)
class Prefetch:
    """A disk read on its way for a waiting request: the blocks from `first` on, read in `generation`."""

    first: BlockHash
    generation: int
    future: Future[list[HostBlock]]


class DiskTier:
    """Blocks as files `<dir>/gen-<N>/<scope>/<key hex>.kv`, raw bytes of the block's tensor, one directory per
    cache scope (weights, adapter, salt: `cache_scope.py`) with that scope in its `scope.json`.

    `manifest.json` names the current generation and what the files were computed by (the checkpoint's
    files, dtype, block shape). A reset writes the next generation into the manifest before it answers,
    then the worker removes the old directory; a write that was in flight lands in the old directory and
    is never read. A scoped reset renames the scope's directories to `dropped-*` before it answers (one
    rename each, whatever they hold; the worker removes them afterwards), so a restart never finds them
    again. A daemon that starts over a directory keeps the manifest's generation only when it matches the
    same checkpoint and shape (a restart keeps the warm disk tier, never one from before a reset or from
    other weights); every other `gen-*` directory, and every `dropped-*` one, is removed.
    """

    name = DISK

    def __init__(
        self,
        root: Path,
        capacity_bytes: int,
        block_shape: tuple[int, ...],
        dtype: torch.dtype,
        identity: dict,
    ) -> None:
        self.root = root
        self.capacity_bytes = capacity_bytes
        self.shape = block_shape
        self.dtype = dtype
        self.block_bytes = torch.Size(block_shape).numel() * torch.finfo(dtype).bits // 8
        self._identity = {
            "format": MANIFEST_FORMAT,
            "shape": list(block_shape),
            "dtype": str(dtype),
            **identity,
        }
        self._lock = threading.Lock()  # the index and generation, shared with the writer thread
        self._index: OrderedDict[BlockHash, str] = OrderedDict()  # key -> its scope's directory name
        self._scopes: dict[str, CacheScope] = {}  # directory name -> scope, for scoped resets
        self._done: list[tuple[str, BlockHash]] = []  # ("stored" | "removed", key) for the engine's events
        self._pending_bytes = 0
        self._writing: dict[BlockHash, str] = {}  # queued writes not discarded since, with their scope
        self._dropped = 0  # scope directories renamed away by scoped resets, for unique names
        self.hit_tokens = self.stored_blocks = self.loaded_blocks = self.dropped_blocks = 0
        root.mkdir(parents=True, exist_ok=True)
        self.generation = self._open()
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._writer = threading.Thread(target=self._write_loop, name="kv-disk-writer", daemon=True)
        self._writer.start()
        self._reader = ThreadPoolExecutor(1, thread_name_prefix="kv-disk-reader")

    # ---- engine thread ---------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._index)

    def __contains__(self, key: BlockHash) -> bool:
        with self._lock:
            return key in self._index

    def prefetch(self, keys: list[BlockHash]) -> Prefetch:
        """Read these blocks on the reader thread; the result stops at the first one that is gone."""
        with self._lock:
            gen = self.generation

        def read() -> list[HostBlock]:
            out = []
            for key in keys:
                block = self.get(key)
                if block is None:
                    break
                out.append(block)
            return out

        return Prefetch(keys[0], gen, self._reader.submit(read))

    def get(self, key: BlockHash) -> HostBlock | None:
        with self._lock:
            scope_dir = self._index.get(key)
            if scope_dir is None:
                return None
            path = self._path(self.generation, scope_dir, key)
        try:
            raw = path.read_bytes()
        except OSError:
            return None  # evicted by the writer meanwhile
        if len(raw) != self.block_bytes:
            log.warning(
                "disk tier: %s has %d bytes, not %d; dropping it", path.name, len(raw), self.block_bytes
            )
            self.discard(key)
            return None
        data = torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(self.dtype).view(self.shape)
        return HostBlock(data)

    def put(self, key: BlockHash, block: HostBlock) -> bool:
        """Queue the block's write (`block.scope` set); False (dropped) when the writer is too far behind."""
        assert block.scope is not None, "a block goes to disk with the scope it was computed under"
        if self._pending_bytes + self.block_bytes > MAX_PENDING_WRITE_BYTES:
            self.dropped_blocks += 1
            return False
        scope_dir = scope_dir_name(block.scope)
        with self._lock:
            self._pending_bytes += self.block_bytes
            self._writing[key] = scope_dir
            self._scopes[scope_dir] = block.scope
            gen = self.generation
        self._queue.put(("write", gen, key, (scope_dir, block)))
        return True

    def discard(self, key: BlockHash) -> bool:
        """Forget the block (its file goes on the writer thread); False when it was not here."""
        with self._lock:
            self._writing.pop(key, None)  # a write on its way is dropped when it lands
            scope_dir = self._index.pop(key, None)
            if scope_dir is None:
                return False
            self._queue.put(("unlink", self.generation, key, scope_dir))
        return True

    def reset(self) -> int:
        """A new generation: nothing stored before is found again, whatever the writer is doing."""
        with self._lock:
            n = len(self._index)
            old, self.generation = self.generation, self.generation + 1
            self._index = OrderedDict()
            self._writing.clear()
            self._scopes.clear()
            self._done.clear()
            (self.root / f"gen-{self.generation}").mkdir(exist_ok=True)
            self._write_manifest()
        self._queue.put(("rmtree", old, None, self.root / f"gen-{old}"))
        return n

    def reset_scopes(self, match: Callable[[CacheScope], bool]) -> list[BlockHash]:
        """Drop the blocks of the scopes `match` names; returns their keys. Each scope's directory is renamed
        away before this returns (a write still in flight for it lands in a directory made anew and is
        dropped there, as a discarded block's is)."""
        with self._lock:
            dirs = {d for d, scope in self._scopes.items() if match(scope)}
            gone = [k for k, d in self._index.items() if d in dirs]
            for k in gone:
                del self._index[k]
            # a "stored" the engine has not drained must not go out after this reset's "removed"
            dropped = set(gone)
            self._done = [(what, k) for what, k in self._done if k not in dropped]
            self._writing = {k: d for k, d in self._writing.items() if d not in dirs}
            gen_dir = self.root / f"gen-{self.generation}"
            for d in dirs:
                del self._scopes[d]
                self._dropped += 1
                away = gen_dir / f"dropped-{self._dropped}-{d}"
                try:
                    os.replace(gen_dir / d, away)
                except FileNotFoundError:
                    continue  # nothing written for it yet
                self._queue.put(("rmtree", 0, None, away))
        return gone

    def drain(self) -> list[tuple[str, BlockHash]]:
        """What the writer stored and evicted since the last call, for the engine's KV events."""
        with self._lock:
            out, self._done = self._done, []
        return out

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every write queued so far has landed (or was dropped); False on timeout."""
        landed = threading.Event()
        self._queue.put(("flush", 0, None, landed))
        return landed.wait(timeout)

    def close(self) -> None:
        self._reader.shutdown(wait=True, cancel_futures=True)
        self._queue.put(None)
        self._writer.join(timeout=30)

    def stats(self) -> TierStats:
        n = len(self._index)
        return TierStats(
            DISK,
            n,
            n * self.block_bytes,
            self.capacity_bytes,
            self.hit_tokens,
            self.stored_blocks,
            self.loaded_blocks,
        )

    # ---- writer thread -------------------------------------------------------------------------
    def _write_loop(self) -> None:
        while (job := self._queue.get()) is not None:
            op, gen, key, arg = job
            try:
                if op == "write":
                    self._write(gen, key, *arg)
                elif op == "unlink":
                    self._path(gen, arg, key).unlink(missing_ok=True)
                elif op == "flush":
                    arg.set()
                else:  # rmtree: an old generation, or a scope a scoped reset renamed away
                    shutil.rmtree(arg, ignore_errors=True)
            except OSError as exc:
                log.warning("disk tier: %s of %s failed: %s", op, key.hex()[:16] if key else arg, exc)

    def _write(self, gen: int, key: BlockHash, scope_dir: str, block: HostBlock) -> None:
        path = self._path(gen, scope_dir, key)
        try:
            block.wait()
            # a block reaches the tiers with its scope (CacheManager.store_offloaded sets it)
            self._make_scope_dir(path.parent, block.scope)  # type: ignore[arg-type]
            tmp = path.with_suffix(".tmp")
            tmp.write_bytes(block.data.contiguous().view(torch.uint8).numpy().tobytes())
            os.replace(tmp, path)
        except OSError:
            with self._lock:
                self._writing.pop(key, None)
            raise
        finally:
            with self._lock:
                self._pending_bytes -= self.block_bytes
        evicted = []
        with self._lock:
            if gen != self.generation:
                return  # a reset came first: the old generation's directory goes, this file with it
            if self._writing.get(key) != scope_dir:  # discarded (the pool computed it again) or reset
                path.unlink(missing_ok=True)
                return
            del self._writing[key]
            self._index[key] = scope_dir
            self._index.move_to_end(key)
            self.stored_blocks += 1
            self._done.append(("stored", key))
            while len(self._index) * self.block_bytes > self.capacity_bytes:
                old, old_dir = self._index.popitem(last=False)
                evicted.append((old, old_dir))
                self._done.append(("removed", old))
        for old, old_dir in evicted:
            self._path(gen, old_dir, old).unlink(missing_ok=True)

    def _make_scope_dir(self, directory: Path, scope: CacheScope) -> None:
        """The scope's directory with its scope.json (written before any block, renamed into place)."""
        if directory.is_dir():
            return
        directory.mkdir(parents=True, exist_ok=True)
        tmp = directory / (SCOPE_FILE + ".tmp")
        tmp.write_text(json.dumps(scope_record(scope)))
        os.replace(tmp, directory / SCOPE_FILE)

    # ---- the directory -------------------------------------------------------------------------
    def _path(self, gen: int, scope_dir: str, key: BlockHash) -> Path:
        return self.root / f"gen-{gen}" / scope_dir / f"{key.hex()}.kv"

    def _open(self) -> int:
        """The generation to serve: the manifest's when it matches these weights and shape, with the
        files it holds; otherwise a new empty one. Other generations, scopes a scoped reset dropped and
        anything that is not a scope directory with its scope.json are removed."""
        gen = 0
        try:
            manifest = json.loads((self.root / MANIFEST).read_text())
            gen = int(manifest["generation"])
            keep = {k: v for k, v in manifest.items() if k != "generation"} == self._identity
        except (OSError, ValueError, KeyError, TypeError):
            keep = False
        if not keep:
            gen += 1
        for d in self.root.glob("gen-*"):
            if d.name != f"gen-{gen}":
                shutil.rmtree(d, ignore_errors=True)
        current = self.root / f"gen-{gen}"
        current.mkdir(exist_ok=True)
        files = []
        for d in current.iterdir():
            scope = self._read_scope(d)
            if scope is None:
                shutil.rmtree(d, ignore_errors=True) if d.is_dir() else d.unlink(missing_ok=True)
                continue
            self._scopes[d.name] = scope
            for p in d.glob("*.tmp"):
                p.unlink(missing_ok=True)
            files += [(p.stat().st_mtime_ns, d.name, p) for p in d.glob("*.kv")]
        for _, scope_dir, p in sorted(files):
            try:
                key = BlockHash(bytes.fromhex(p.stem))
            except ValueError:
                key = None
            if key is None or p.stat().st_size != self.block_bytes:
                p.unlink(missing_ok=True)
                continue
            self._index[key] = scope_dir
        while len(self._index) * self.block_bytes > self.capacity_bytes:
            old, old_dir = self._index.popitem(last=False)
            self._path(gen, old_dir, old).unlink(missing_ok=True)
        self.generation = gen
        self._write_manifest()
        if self._index:
            log.info(
                "disk tier %s: %d blocks kept from before this start (generation %d)",
                self.root,
                len(self._index),
                gen,
            )
        return gen

    @staticmethod
    def _read_scope(d: Path) -> CacheScope | None:
        """A scope directory's scope; None for a `dropped-*` one, a stray file, or a scope.json that does
        not parse or is over MAX_SCOPE_FILE_BYTES (all removed: a block must never be served under a scope
        it was not computed in)."""
        if not d.is_dir() or d.name.startswith("dropped-"):
            return None
        try:
            with open(d / SCOPE_FILE, "rb") as f:
                raw = f.read(MAX_SCOPE_FILE_BYTES + 1)
            if len(raw) > MAX_SCOPE_FILE_BYTES:
                return None
            scope = scope_from_record(json.loads(raw))
        except (OSError, ValueError, TypeError, KeyError, RecursionError):
            return None
        return scope if scope_dir_name(scope) == d.name else None

    def _write_manifest(self) -> None:
        tmp = self.root / (MANIFEST + ".tmp")
        tmp.write_text(json.dumps({**self._identity, "generation": self.generation}))
        os.replace(tmp, self.root / MANIFEST)


def checkpoint_files(model_dir: Path) -> list[list]:
    """What the disk tier's blocks were computed from: each checkpoint file's name, size and mtime (a
    digest of gigabytes would cost a start seconds; a changed file changes its size or mtime)."""
    return [
        [p.name, p.stat().st_size, p.stat().st_mtime_ns]
        for p in sorted(model_dir.iterdir())
        if p.suffix in (".safetensors", ".bin", ".json") and p.is_file()
    ]


class KVOffload:
    """The tiers below the pool, host then disk (either may be off), as the cache manager sees them."""

    def __init__(
        self,
        host: HostTier | None,
        disk: DiskTier | None,
        on_stored: Callable[[BlockHash, str], None] | None = None,
        on_removed: Callable[[BlockHash, str], None] | None = None,
    ) -> None:
        self.tiers: tuple[HostTier | DiskTier, ...] = tuple(t for t in (host, disk) if t is not None)
        self.host, self.disk = host, disk
        self._prefetches: dict[str, Prefetch] = {}  # request id -> its disk read on its way
        # KV events (medium per tier); the engine sets them when it publishes events.
        self.on_stored, self.on_removed = on_stored, on_removed

    @property
    def capacity_blocks(self) -> int:
        return sum(t.capacity_bytes // t.block_bytes for t in self.tiers)

    def find(
        self, request_id: str, keys: list[BlockHash]
    ) -> list[tuple[HostTier | DiskTier, BlockHash, HostBlock]] | None:
        """The longest run of `keys` (the rest of a prefix the pool missed) held in the tiers: host first,
        then disk. Disk blocks are read off the engine's thread: the first call starts the read and
        answers None (the request waits, the step goes on without it); a later one takes the blocks."""
        found: list[tuple[HostTier | DiskTier, BlockHash, HostBlock]] = []
        host, disk = self.host, self.disk
        while host is not None and len(found) < len(keys) and (b := host.get(keys[len(found)])) is not None:
            found.append((host, keys[len(found)], b))
        rest = keys[len(found) :]
        if disk is None or not rest or rest[0] not in disk:
            return found
        pending = self._prefetches.get(request_id)
        if pending is None or pending.first != rest[0] or pending.generation != disk.generation:
            self._prefetches[request_id] = disk.prefetch(rest)
            return None
        if not pending.future.done():
            return None
        del self._prefetches[request_id]
        return found + [(disk, k, b) for k, b in zip(rest, pending.future.result())]

    def wait_for_reads(self, timeout: float) -> None:
        """A step with nothing to run but requests waiting on disk: wait for a read, not spin."""
        if self._prefetches:
            wait([p.future for p in self._prefetches.values()], timeout, FIRST_COMPLETED)

    def forget(self, request_id: str) -> None:
        """The request left the queue: drop a read it no longer needs."""
        self._prefetches.pop(request_id, None)

    def take(self, tier: HostTier | DiskTier, key: BlockHash) -> None:
        """The block was copied back into the pool: it leaves its tier."""
        if tier.discard(key):
            tier.loaded_blocks += 1
            self._removed(key, tier.name)

    def store(self, key: BlockHash, block: HostBlock) -> None:
        """A block the pool evicted: into the host tier (its overflow to disk), or straight to disk."""
        if self.host is None:
            # an offload without a host tier has a disk tier (it is made only with one of them)
            self.disk.put(key, block)  # type: ignore[union-attr]
            return
        pushed_out = self.host.put(key, block)
        self._stored(key, HOST)
        for old_key, old in pushed_out:
            self._removed(old_key, HOST)
            if self.disk is not None:
                self.disk.put(old_key, old)

    def discard(self, key: BlockHash) -> None:
        """The pool indexed this key again (computed anew): no tier keeps a second copy."""
        if self.host is not None and self.host.discard(key):
            self._removed(key, HOST)
        if self.disk is not None and self.disk.discard(key):
            self._removed(key, DISK)

    def reset(self) -> dict[str, int]:
        return {t.name: t.reset() for t in self.tiers}

    def reset_scopes(self, match: Callable[[CacheScope], bool]) -> dict[str, int]:
        """The blocks of those scopes in each tier; each key removed is told to the events (a full reset's
        AllBlocksCleared covers them; a scoped one must name them)."""
        # A disk read made before this reset may hold the scope's blocks: requests ask again.
        self._prefetches.clear()
        out = {}
        if self.host is not None:
            gone = self.host.reset_scopes(match)
            for key in gone:
                self._removed(key, HOST)
            out[HOST] = len(gone)
        if self.disk is not None:
            gone = self.disk.reset_scopes(match)
            for key in gone:
                self._removed(key, DISK)
            out[DISK] = len(gone)
        return out

    def poll(self) -> None:
        """Tell the events what the disk writer did since the last step."""
        if self.disk is None:
            return
        for what, key in self.disk.drain():
            (self._stored if what == "stored" else self._removed)(key, DISK)

    def stats(self) -> tuple[TierStats, ...]:
        return tuple(t.stats() for t in self.tiers)

    def close(self) -> None:
        if self.disk is not None:
            self.disk.close()

    def _stored(self, key: BlockHash, tier: str) -> None:
        if self.on_stored is not None:
            self.on_stored(key, MEDIUM[tier])

    def _removed(self, key: BlockHash, tier: str) -> None:
        if self.on_removed is not None:
            self.on_removed(key, MEDIUM[tier])
