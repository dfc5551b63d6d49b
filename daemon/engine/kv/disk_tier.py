"""The disk tier below the host tier: blocks as files, one generation directory per reset and one
directory per cache scope in it (the tiers as a whole: offload.py)."""

from __future__ import annotations

import json
import logging
import os
import queue
import shutil
import stat
import threading
from collections import Counter, OrderedDict
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch

from kvpilot.daemon.engine.kv.cache_scope import CacheScope, scope_dir_name, scope_from_record, scope_record
from kvpilot.daemon.engine.kv.host_tier import HostBlock
from kvpilot.daemon.engine.outputs import TierStats
from kvpilot.kv.block_keys import BlockHash

log = logging.getLogger(__name__)


DISK = "disk"
MANIFEST = "manifest.json"
MANIFEST_FORMAT = "kvpilot-kv-offload-v2"  # v2: a directory per cache scope in each generation
SCOPE_FILE = "scope.json"
# A scope.json holds a weight version, an adapter name and digest and a salt, each bounded where the daemon
# takes it (well under 8 KiB together); a bigger one is not the daemon's and is removed unread.
MAX_SCOPE_FILE_BYTES = 64 << 10
# The manifest names the checkpoint's files with their sizes and times: a few KiB.
MAX_MANIFEST_BYTES = 1 << 20
# What a scope's directory costs on disk besides its blocks, counted against the tier's capacity: the
# directory's own block and its scope.json (a salt of up to 4,096 characters and the rest).
SCOPE_DIR_BYTES = 12 << 10
# Host memory the disk writer may hold in queued blocks; past it a block the host tier evicts is dropped
# instead of spilled (a slow disk must not grow the daemon's memory without bound).
MAX_PENDING_WRITE_BYTES = 256 << 20


@dataclass(frozen=True, slots=True)
class Prefetch:
    """A disk read on its way for a waiting request: the blocks from `first` on, read in `generation`."""

    first: BlockHash
    generation: int
    future: Future[list[HostBlock]]


# The writer thread's work, each (what, generation, key, what it needs): a block to write in its scope's
# directory, a block's file to remove, a directory to remove, an event to set once what came before landed.
_Job = (
    tuple[Literal["write"], int, BlockHash, tuple[str, HostBlock]]
    | tuple[Literal["unlink"], int, BlockHash, str]
    | tuple[Literal["rmtree"], int, None, Path]
    | tuple[Literal["flush"], int, None, threading.Event]
)


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
        identity: Mapping[str, object],  # what the blocks were computed from, kept in the manifest
        scope_bytes: int = SCOPE_DIR_BYTES,  # each scope directory's charge against the capacity
    ) -> None:
        self.root = root
        self.scope_bytes = scope_bytes
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
        # Directory name -> its blocks stored or on their way; a scope whose count falls to 0 is forgotten
        # and its directory removed, so scopes cost memory and disk only while they hold blocks.
        self._refs: Counter[str] = Counter()
        # Directory name -> its blocks stored: the scopes the capacity charges (not those with writes only
        # on their way, which would evict stored blocks for writes that may never land).
        self._stored_in: Counter[str] = Counter()
        self._done: list[tuple[str, BlockHash]] = []  # ("stored" | "removed", key) for the engine's events
        self._pending_bytes = 0
        self._writing: dict[BlockHash, str] = {}  # queued writes not discarded since, with their scope
        self._dropped = 0  # scope directories renamed away by scoped resets, for unique names
        self.hit_tokens = self.stored_blocks = self.loaded_blocks = self.dropped_blocks = 0
        root.mkdir(parents=True, exist_ok=True)
        self._queue: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()  # None: stop
        self.generation = self._open()
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
            raw = read_regular_file(path, self.block_bytes)
        except FileNotFoundError:
            self.discard(key)  # evicted by the writer meanwhile (then no longer indexed), or lost
            return None
        except OSError:
            return None
        if raw is None or len(raw) != self.block_bytes:
            log.warning("disk tier: %s is not a file of %d bytes; dropping it", path.name, self.block_bytes)
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
            self._scopes[scope_dir] = block.scope
            self._refs[scope_dir] += 1  # before the write it replaces lets go: the scope never falls to 0
            if (before := self._writing.get(key)) is not None:  # that write is dropped when it lands
                self._unref(before)
            self._writing[key] = scope_dir
            gen = self.generation
        self._queue.put(("write", gen, key, (scope_dir, block)))
        return True

    def discard(self, key: BlockHash) -> bool:
        """Forget the block (its file goes on the writer thread); False when it was not here."""
        with self._lock:
            if (writing := self._writing.pop(key, None)) is not None:  # dropped when it lands
                self._unref(writing)
            scope_dir = self._unindex(key)
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
            self._refs.clear()
            self._stored_in.clear()
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
                self._refs.pop(d, None)
                self._stored_in.pop(d, None)
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
            try:
                if job[0] == "write":
                    _, gen, key, (scope_dir, block) = job
                    self._write(gen, key, scope_dir, block)
                elif job[0] == "unlink":
                    _, gen, key, scope_dir = job
                    self._path(gen, scope_dir, key).unlink(missing_ok=True)
                elif job[0] == "flush":
                    job[3].set()
                else:  # rmtree: an old generation, or a scope a scoped reset renamed away
                    shutil.rmtree(job[3], ignore_errors=True)
            except OSError as exc:
                what = job[2].hex()[:16] if job[2] else job[3]
                log.warning("disk tier: %s of %s failed: %s", job[0], what, exc)
            except Exception:  # a bug: the writer goes on, or every later flush would wait for ever
                log.exception("disk tier: %s failed", job[0])

    def _write(self, gen: int, key: BlockHash, scope_dir: str, block: HostBlock) -> None:
        path = self._path(gen, scope_dir, key)
        tmp = path.with_suffix(".tmp")
        try:
            block.wait()
            with self._lock:
                if not self._wanted(gen, key, scope_dir):  # overtaken while queued: the disk is not touched
                    return
            # a block reaches the tiers from the pool's index, so it has its scope (not re-checked here)
            self._make_scope_dir(path.parent, block.scope)  # type: ignore[arg-type]
            write_new_file(tmp, block.data.contiguous().view(torch.uint8).numpy().tobytes())
            evicted = self._land(gen, key, scope_dir, tmp, path)
        except Exception:
            with self._lock:
                if self._writing.get(key) == scope_dir:
                    del self._writing[key]
                    self._unref(scope_dir)
            raise
        finally:
            with self._lock:
                self._pending_bytes -= self.block_bytes
        for old, old_dir in evicted:
            self._path(gen, old_dir, old).unlink(missing_ok=True)

    def _wanted(self, gen: int, key: BlockHash, scope_dir: str) -> bool:
        """Whether a queued write still stands (the lock held): no reset of its generation or scope, no
        discard (the pool computed the block again) since it was queued."""
        return gen == self.generation and self._writing.get(key) == scope_dir

    def _land(
        self, gen: int, key: BlockHash, scope_dir: str, tmp: Path, path: Path
    ) -> list[tuple[BlockHash, str]]:
        """The written block renamed into place and indexed, under the lock a reset takes: a block a reset
        overtook never reaches its place (a crash leaves a `.tmp`, which a start removes), nor a scope
        directory made again for it. The blocks evicted to make room, whose files the caller removes."""
        evicted: list[tuple[BlockHash, str]] = []
        with self._lock:
            if not self._wanted(gen, key, scope_dir):
                tmp.unlink(missing_ok=True)
                if gen == self.generation and scope_dir not in self._refs:  # a scope reset meanwhile
                    self._queue.put(("rmtree", gen, None, path.parent))
                return evicted
            os.replace(tmp, path)
            self._unindex(key)  # stored before, maybe in another scope
            del self._writing[key]  # its count goes on as the stored block's
            self._index[key] = scope_dir
            self._stored_in[scope_dir] += 1
            self.stored_blocks += 1
            self._done.append(("stored", key))
            while self._index and self._used_bytes() > self.capacity_bytes:
                old = next(iter(self._index))
                if (old_dir := self._unindex(old)) is not None:
                    evicted.append((old, old_dir))
                self._done.append(("removed", old))
        return evicted

    def _unindex(self, key: BlockHash) -> str | None:
        """Drop a stored block from the index (the lock held); its scope directory's name, None when it was
        not stored."""
        scope_dir = self._index.pop(key, None)
        if scope_dir is not None:
            self._stored_in[scope_dir] -= 1
            if self._stored_in[scope_dir] <= 0:
                del self._stored_in[scope_dir]
            self._unref(scope_dir)
        return scope_dir

    def _used_bytes(self) -> int:
        return len(self._index) * self.block_bytes + len(self._stored_in) * self.scope_bytes

    def _unref(self, scope_dir: str) -> None:
        """One block of the scope fewer (the lock held); at none, the scope and its directory go."""
        self._refs[scope_dir] -= 1
        if self._refs[scope_dir] <= 0:
            del self._refs[scope_dir]
            self._scopes.pop(scope_dir, None)
            # after any job queued for it; a write queued later makes the directory anew
            self._queue.put(
                ("rmtree", self.generation, None, self.root / f"gen-{self.generation}" / scope_dir)
            )

    def _make_scope_dir(self, directory: Path, scope: CacheScope) -> None:
        """The scope's directory with its scope.json (written before any block, renamed into place)."""
        if directory.is_dir() and not directory.is_symlink():
            return
        _remove(directory)  # a link put in its place is never written through
        directory.mkdir(parents=True, exist_ok=True)
        tmp = directory / (SCOPE_FILE + ".tmp")
        write_new_file(tmp, json.dumps(scope_record(scope)).encode())
        os.replace(tmp, directory / SCOPE_FILE)

    # ---- the directory -------------------------------------------------------------------------
    def _path(self, gen: int, scope_dir: str, key: BlockHash) -> Path:
        return self.root / f"gen-{gen}" / scope_dir / f"{key.hex()}.kv"

    def _open(self) -> int:
        """The generation to serve: the manifest's when it matches these weights and shape, with the
        files it holds; otherwise a new one, emptied first. Other generations, scopes a scoped reset
        dropped and anything that is not a scope directory with its scope.json are removed.

        Whoever else can write the directory is not trusted: links are removed, never followed (a `gen-N`
        linked elsewhere would have this start delete the target's files), only regular files are read, each
        within its bound (a FIFO would block the start, /dev/zero fill memory), and without a matching
        manifest nothing found is kept (a block planted under a predictable key would be served)."""
        gen, keep = 0, False
        try:
            raw = read_regular_file(self.root / MANIFEST, MAX_MANIFEST_BYTES)
            if raw is not None:
                manifest = json.loads(raw)
                gen = int(manifest["generation"])
                keep = {k: v for k, v in manifest.items() if k != "generation"} == self._identity
        except (OSError, ValueError, KeyError, TypeError, RecursionError):
            keep = False
        if not 0 <= gen < 1 << 62:
            gen, keep = 0, False
        if not keep:
            gen += 1
            _remove(self.root / MANIFEST)  # whatever stands there (a directory would refuse the new one)
        for d in self.root.glob("gen-*"):
            if d.name != f"gen-{gen}" or not keep:
                _remove(d)
        current = self.root / f"gen-{gen}"
        if current.is_symlink() or (current.exists() and not current.is_dir()):
            _remove(current)
        current.mkdir(exist_ok=True)
        files = []
        for d in current.iterdir():
            scope = self._read_scope(d)
            if scope is None:
                _remove(d)
                continue
            self._scopes[d.name] = scope
            for p in d.glob("*.tmp"):
                _remove(p)
            files += [(p.lstat(), d.name, p) for p in d.glob("*.kv")]
        for st, scope_dir, p in sorted(files, key=lambda f: f[0].st_mtime_ns):
            try:
                key = BlockHash(bytes.fromhex(p.stem))
            except ValueError:
                key = None
            if key is None or not stat.S_ISREG(st.st_mode) or st.st_size != self.block_bytes:
                _remove(p)
                continue
            self._index[key] = scope_dir
        self._refs.update(self._index.values())
        self._stored_in.update(self._index.values())
        for empty in [name for name in self._scopes if name not in self._refs]:  # no block left in it
            del self._scopes[empty]
            _remove(current / empty)
        self.generation = gen
        while self._index and self._used_bytes() > self.capacity_bytes:
            old = next(iter(self._index))
            if (old_dir := self._unindex(old)) is not None:
                self._path(gen, old_dir, old).unlink(missing_ok=True)
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
        if d.is_symlink() or not d.is_dir() or d.name.startswith("dropped-"):
            return None
        try:
            raw = read_regular_file(d / SCOPE_FILE, MAX_SCOPE_FILE_BYTES)
            if raw is None:
                return None
            scope = scope_from_record(json.loads(raw))
        except (OSError, ValueError, TypeError, KeyError, RecursionError):
            return None
        return scope if scope_dir_name(scope) == d.name else None

    def _write_manifest(self) -> None:
        tmp = self.root / (MANIFEST + ".tmp")
        write_new_file(tmp, json.dumps({**self._identity, "generation": self.generation}).encode())
        os.replace(tmp, self.root / MANIFEST)


def read_regular_file(path: Path, max_bytes: int) -> bytes | None:
    """The bytes of `path` when it is a regular file of at most `max_bytes`; None when it is a FIFO, a
    device, a directory or larger. Never blocks on a FIFO, never reads past the bound. OSError when it
    cannot be opened: it is gone, or it is a link (ELOOP: a link is never followed)."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)  # before fdopen, which refuses a directory and would leave the descriptor open
        return None
    with os.fdopen(fd, "rb") as f:
        raw = f.read(max_bytes + 1)
    return raw if len(raw) <= max_bytes else None


def write_new_file(path: Path, data: bytes) -> None:
    """Write `data` as a new file of the daemon's own (mode 0600: KV and scopes are the tenants' data).
    Whatever stands at `path` goes first; O_EXCL|O_NOFOLLOW then refuse a link put back there meanwhile
    rather than write through it (the file is a temporary one, renamed into place, which replaces a link
    and never follows it)."""
    _remove(path)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def _remove(path: Path) -> None:
    """Remove a file, a link (never what it points to) or a directory tree; whatever is gone already is
    fine."""
    if path.is_symlink() or not path.is_dir():
        path.unlink(missing_ok=True)
    else:
        shutil.rmtree(path, ignore_errors=True)


def checkpoint_files(model_dir: Path) -> list[list[str | int]]:
    """What the disk tier's blocks were computed from: each checkpoint file's name, size and mtime (a
    digest of gigabytes would cost a start seconds; a changed file changes its size or mtime)."""
    return [
        [p.name, p.stat().st_size, p.stat().st_mtime_ns]
        for p in sorted(model_dir.iterdir())
        if p.suffix in (".safetensors", ".bin", ".json") and p.is_file()
    ]
