"""The offload tiers' bookkeeping on real files, without the model: LRU within capacity, writes that a
discard or a reset overtakes, and what a restart keeps."""

from __future__ import annotations

import json
import os
import shutil
import threading
from pathlib import Path

import pytest
import torch

from kvpilot.daemon.engine.kv.cache_scope import CacheScope, scope_dir_name, scope_record
from kvpilot.daemon.engine.kv.disk_tier import MAX_SCOPE_FILE_BYTES, DiskTier
from kvpilot.daemon.engine.kv.host_tier import HostBlock, HostTier
from kvpilot.daemon.engine.kv.offload import KVOffload
from kvpilot.kv.block_keys import BlockHash

SHAPE = (2, 2, 4, 1, 8)  # layers, K/V, block_size, kv heads, head dim
BLOCK_BYTES = 2 * 2 * 4 * 8 * 4
IDENTITY = {"model": "m", "files": [["model.safetensors", 10, 1]]}
BASE = CacheScope(None, None, None)
TENANT = CacheScope(None, None, "tenant-a")


def key(i: int) -> BlockHash:
    return BlockHash(i.to_bytes(32, "big"))


def block(i: int, scope: CacheScope = BASE, ready: object | None = None) -> HostBlock:
    return HostBlock(torch.full(SHAPE, float(i)), ready, scope)


def scope_dir(root: Path, disk: DiskTier, scope: CacheScope = BASE) -> Path:
    return root / f"gen-{disk.generation}" / scope_dir_name(scope)


def disk_tier(root: Path, blocks: int = 8, identity: dict = IDENTITY, scope_bytes: int = 0) -> DiskTier:
    """A tier of `blocks` blocks (its scope directories free, unless `scope_bytes` says what each costs)."""
    return DiskTier(root, blocks * BLOCK_BYTES, SHAPE, torch.float32, identity, scope_bytes)


class Gate:
    """Stands in for the CUDA event that says a block's copy off the GPU has landed: the disk writer waits
    on it before writing, so a test can hold a write on its way."""

    def __init__(self) -> None:
        self.opened = threading.Event()

    def synchronize(self) -> None:
        self.opened.wait(10)


def test_host_tier_keeps_the_most_recent_blocks_within_capacity() -> None:
    host = HostTier(3 * BLOCK_BYTES, BLOCK_BYTES)
    pushed = [k for i in range(5) for k, _ in host.put(key(i), block(i))]
    assert pushed == [key(0), key(1)]
    assert [host.get(key(i)) is not None for i in range(5)] == [False, False, True, True, True]
    assert host.stats().bytes == 3 * BLOCK_BYTES
    assert host.reset() == 3 and host.get(key(4)) is None


def test_disk_blocks_round_trip_and_lru(tmp_path: Path) -> None:
    disk = disk_tier(tmp_path, blocks=3)
    for i in range(5):
        assert disk.put(key(i), block(i))
    assert disk.flush(10)
    assert [key(i) in disk for i in range(5)] == [False, False, True, True, True]
    assert torch.equal(disk.get(key(4)).data, block(4).data)
    assert sorted(p.name for p in scope_dir(tmp_path, disk).glob("*.kv")) == sorted(
        f"{key(i).hex()}.kv" for i in (2, 3, 4)
    )
    events = disk.drain()
    assert [k for what, k in events if what == "stored"] == [key(i) for i in range(5)]
    assert [k for what, k in events if what == "removed"] == [key(0), key(1)]
    disk.close()


def test_a_discard_or_a_reset_overtakes_a_write_on_its_way(tmp_path: Path) -> None:
    disk = disk_tier(tmp_path)
    gate = Gate()
    disk.put(key(1), block(1, ready=gate))
    disk.put(key(2), block(2))
    assert not disk.discard(key(1)), "not on disk yet"  # the pool computed it again meanwhile
    gate.opened.set()
    assert disk.flush(10)
    assert key(1) not in disk and key(2) in disk, "the discarded write was dropped when it landed"
    assert not (scope_dir(tmp_path, disk) / f"{key(1).hex()}.kv").exists()

    gate = Gate()
    disk.put(key(3), block(3, ready=gate))
    old = disk.generation
    assert disk.reset() == 1
    gate.opened.set()  # key(3) lands in the old generation, after the reset
    assert disk.flush(10)
    assert len(disk) == 0 and key(3) not in disk
    assert not (tmp_path / f"gen-{old}").exists()
    disk.close()


def test_a_restart_keeps_the_same_checkpoints_blocks_only(tmp_path: Path) -> None:
    disk = disk_tier(tmp_path)
    disk.put(key(1), block(1))
    assert disk.flush(10)
    disk.close()

    again = disk_tier(tmp_path)
    assert key(1) in again and torch.equal(again.get(key(1)).data, block(1).data)
    again.close()

    other = disk_tier(tmp_path, identity=IDENTITY | {"files": [["model.safetensors", 11, 2]]})
    assert len(other) == 0 and key(1) not in other, "other weights: nothing kept"
    assert [p.name for p in tmp_path.glob("gen-*")] == [f"gen-{other.generation}"]
    other.close()


def test_offload_moves_host_overflow_to_disk_and_reports_media(tmp_path: Path) -> None:
    events: list[tuple[str, BlockHash, str]] = []
    tiers = KVOffload(
        HostTier(2 * BLOCK_BYTES, BLOCK_BYTES),
        disk_tier(tmp_path),
        on_stored=lambda k, m: events.append(("stored", k, m)),
        on_removed=lambda k, m: events.append(("removed", k, m)),
    )
    for i in range(3):
        tiers.store(key(i), block(i))
    assert tiers.disk.flush(10)
    tiers.poll()
    assert ("removed", key(0), "CPU") in events and ("stored", key(0), "STORAGE") in events
    found = tiers.find("r", [key(1), key(2)])
    assert [(t.name, k) for t, k, _ in found] == [("host", key(1)), ("host", key(2))]
    assert tiers.find("r", [key(0)]) is None  # on disk: the read starts, the request waits
    tiers.wait_for_reads(10)
    ((t, k, b),) = tiers.find("r", [key(0)])
    assert (t.name, k) == ("disk", key(0)) and torch.equal(b.data, block(0).data)
    tiers.discard(key(0))
    assert ("removed", key(0), "STORAGE") in events and key(0) not in tiers.disk
    assert tiers.reset() == {"host": 2, "disk": 0}
    tiers.close()


def test_a_scoped_reset_drops_its_scope_on_disk_and_a_restart_does_not_bring_it_back(tmp_path: Path) -> None:
    disk = disk_tier(tmp_path)
    for i in range(3):
        disk.put(key(i), block(i, TENANT))
    disk.put(key(7), block(7))
    assert disk.flush(10)
    gate = Gate()
    disk.put(key(5), block(5, TENANT, ready=gate))  # on its way when its scope is reset
    gone = disk.reset_scopes(lambda s: s.cache_salt == "tenant-a")
    assert sorted(gone) == [key(0), key(1), key(2)]
    assert not scope_dir(tmp_path, disk, TENANT).exists()  # renamed away before the reset answered
    gate.opened.set()
    assert disk.flush(10)
    assert [key(i) in disk for i in (0, 1, 2, 5, 7)] == [False, False, False, False, True]
    assert disk.reset_scopes(lambda s: s.cache_salt == "tenant-a") == []
    disk.close()

    again = disk_tier(tmp_path)  # the same checkpoint: the generation is kept, the dropped scope is not
    assert [key(i) in again for i in (0, 1, 2, 5, 7)] == [False, False, False, False, True]
    assert not list((tmp_path / f"gen-{again.generation}").glob("dropped-*"))
    assert torch.equal(again.get(key(7)).data, block(7).data)
    again.close()


@pytest.mark.parametrize("record", ["other scope", "oversized", "nested"])
def test_a_scope_directory_that_does_not_say_its_scope_is_removed_at_start(
    tmp_path: Path, record: str
) -> None:
    """A scope.json naming another scope, one over MAX_SCOPE_FILE_BYTES (read no further than its cap) or
    one nested past the JSON parser's depth: its directory is removed, the rest of the tier kept."""
    disk = disk_tier(tmp_path)
    disk.put(key(1), block(1, TENANT))
    disk.put(key(2), block(2))
    assert disk.flush(10)
    disk.close()
    text = {
        "other scope": '{"weight_key": null, "lora": null, "cache_salt": "other"}',
        "oversized": '{"weight_key": null, "lora": null, "cache_salt": "tenant-a", "pad": "%s"}'
        % ("x" * MAX_SCOPE_FILE_BYTES),
        "nested": "[" * 100_000,
    }[record]
    (scope_dir(tmp_path, disk, TENANT) / "scope.json").write_text(text)
    again = disk_tier(tmp_path)
    assert key(1) not in again and key(2) in again  # never served under a scope it was not computed in
    again.close()


# Whoever else can write the tier's directory is not trusted (docs/security.md): each case below was an
# attack on the old code, reproduced on real files.


@pytest.mark.parametrize("manifest", ["missing", "other weights"])
def test_blocks_found_without_a_matching_manifest_are_never_served(tmp_path: Path, manifest: str) -> None:
    """Without a manifest (or with another checkpoint's) the generation the tier opens next is predictable:
    a block planted there under a predictable key must not be served, so the tier empties it first."""
    disk = disk_tier(tmp_path)
    disk.put(key(1), block(1))
    assert disk.flush(10)
    disk.close()
    identity = IDENTITY
    if manifest == "missing":
        (tmp_path / "manifest.json").unlink()  # the next generation is the first again: this very one
    else:
        identity = IDENTITY | {"files": [["model.safetensors", 11, 2]]}
        planted = tmp_path / f"gen-{disk.generation + 1}"
        shutil.copytree(tmp_path / f"gen-{disk.generation}", planted)
    again = disk_tier(tmp_path, identity=identity)
    assert len(again) == 0 and key(1) not in again and again.get(key(1)) is None
    assert not any((tmp_path / f"gen-{again.generation}").iterdir())
    again.close()


def test_a_generation_linked_elsewhere_is_unlinked_never_emptied(tmp_path: Path) -> None:
    root, outside = tmp_path / "tier", tmp_path / "outside"
    disk = disk_tier(root)
    disk.put(key(1), block(1))
    assert disk.flush(10)
    disk.close()
    outside.mkdir()
    (outside / "precious.txt").write_text("not the tier's")
    (outside / "dir").mkdir()
    current = root / f"gen-{disk.generation}"
    shutil.rmtree(current)
    current.symlink_to(outside, target_is_directory=True)
    again = disk_tier(root)
    assert (outside / "precious.txt").read_text() == "not the tier's" and (outside / "dir").is_dir()
    current = root / f"gen-{again.generation}"
    assert current.is_dir() and not current.is_symlink()
    again.close()


def test_a_write_a_scoped_reset_overtook_never_reaches_the_disk(tmp_path: Path) -> None:
    """A block queued for a scope that a scoped reset then dropped: its write lands after the reset, and
    made the scope's directory and scope.json again with the block in it until the landing removed it (a
    crash in between left a block a restart served). It never reaches its place now, nor its directory."""
    disk = disk_tier(tmp_path)
    gate = Gate()
    disk.put(key(1), block(1, TENANT, ready=gate))
    assert disk.reset_scopes(lambda s: s == TENANT) == []  # not stored yet
    gate.opened.set()
    assert disk.flush(10) and disk.flush(10)
    assert not scope_dir(tmp_path, disk, TENANT).exists() and key(1) not in disk
    disk.close()
    again = disk_tier(tmp_path)
    assert key(1) not in again
    again.close()


def test_a_block_put_twice_before_it_lands_is_stored_once_with_its_file(tmp_path: Path) -> None:
    """The second put of a key replaces the first write's claim on the scope before letting it go: the
    scope's count never falls to 0 between them (which queued its directory's removal after the first
    write, taking the stored block's file with it: indexed, announced, and gone)."""
    disk = disk_tier(tmp_path)
    gate = Gate()
    disk.put(key(1), block(1, TENANT, ready=gate))
    disk.put(key(1), block(1, TENANT))
    gate.opened.set()
    assert disk.flush(10) and disk.flush(10)
    assert key(1) in disk and torch.equal(disk.get(key(1)).data, block(1).data)
    assert disk.get(key(1)) is not None and len(disk) == 1
    disk.close()


def test_scope_directories_count_against_the_cap_and_go_with_their_blocks(tmp_path: Path) -> None:
    """A client sending a new salt per request made a scope directory (and scope.json) per salt, never
    removed and not counted: 465 MB on disk against a 10 MiB cap. Each directory now costs its share of the
    capacity and goes, with its memory, when its last block does; a restart keeps only scopes with blocks."""
    disk = disk_tier(tmp_path, blocks=4, scope_bytes=BLOCK_BYTES)  # room for 2 blocks of 2 scopes, or so
    salted = [CacheScope(None, None, f"salt-{i}" + "s" * 4000) for i in range(50)]
    for i, scope in enumerate(salted):
        assert disk.put(key(i), block(i, scope))
    assert disk.flush(10) and disk.flush(10)  # the second: after the removals the writes queued
    gen = tmp_path / f"gen-{disk.generation}"
    dirs = sorted(d.name for d in gen.iterdir())
    assert dirs == sorted(scope_dir_name(s) for s in salted[-2:]), dirs
    assert len(disk._scopes) == 2 and len(disk) == 2 and key(49) in disk
    disk.discard(key(48))
    assert disk.flush(10)
    assert sorted(d.name for d in gen.iterdir()) == [scope_dir_name(salted[49])]
    disk.close()
    (gen / scope_dir_name(salted[0])).mkdir()  # a scope without blocks (a crash before its removal)
    (gen / scope_dir_name(salted[0]) / "scope.json").write_text(json.dumps(scope_record(salted[0])))
    again = disk_tier(tmp_path, blocks=4, scope_bytes=BLOCK_BYTES)
    assert sorted(d.name for d in gen.iterdir()) == [scope_dir_name(salted[49])] and key(49) in again
    again.close()


def test_the_tiers_own_writes_never_follow_a_link(tmp_path: Path) -> None:
    """Links planted where the tier writes next (the manifest's and a block's temporary files, a scope's
    directory) are replaced, never written through: the files they point to keep their bytes."""
    root, outside = tmp_path / "tier", tmp_path / "outside"
    outside.mkdir()
    victim = outside / "precious.txt"
    victim.write_text("not the tier's")
    disk = disk_tier(root)
    (root / "manifest.json.tmp").symlink_to(victim)
    (scope_dir(root, disk, TENANT)).symlink_to(outside, target_is_directory=True)
    disk.put(key(1), block(1, TENANT))
    assert disk.flush(10)
    disk.close()
    again = disk_tier(root)  # writes its manifest
    planted = scope_dir(root, again) / f"{key(2).hex()}.tmp"
    planted.parent.mkdir(parents=True, exist_ok=True)
    planted.symlink_to(victim)
    again.put(key(2), block(2))
    assert again.flush(10)
    assert key(1) in again and key(2) in again
    assert victim.read_text() == "not the tier's" and sorted(p.name for p in outside.iterdir()) == [
        "precious.txt"
    ]
    assert not scope_dir(root, again, TENANT).is_symlink()
    assert (scope_dir(root, again) / f"{key(2).hex()}.kv").stat().st_mode & 0o777 == 0o600
    again.close()


@pytest.mark.parametrize("kind", ["fifo", "directory"])
@pytest.mark.parametrize("name", ["manifest.json", "scope.json", "block"])
def test_a_fifo_or_a_directory_in_place_of_a_file_never_stops_the_start(
    tmp_path: Path, name: str, kind: str
) -> None:
    """A FIFO would block a plain open() forever, a directory made unlink() raise; the tier opens without
    blocking, reads regular files only and drops what is not one, so the start finishes and nothing unread
    is served."""
    disk = disk_tier(tmp_path)
    disk.put(key(1), block(1))
    assert disk.flush(10)
    disk.close()
    scope = scope_dir(tmp_path, disk)
    path = {
        "manifest.json": tmp_path / "manifest.json",
        "scope.json": scope / "scope.json",
        "block": scope / f"{key(1).hex()}.kv",
    }[name]
    path.unlink()
    os.mkfifo(path) if kind == "fifo" else path.mkdir()
    opened: list[DiskTier] = []
    start = threading.Thread(target=lambda: opened.append(disk_tier(tmp_path)), daemon=True)
    start.start()
    start.join(30)
    try:
        assert opened, f"the start blocked on a FIFO as {name}"
        assert key(1) not in opened[0]
    finally:
        if start.is_alive() and kind == "fifo":  # the old code's open() waits for a writer: be it
            with open(path, "wb"):
                pass
            start.join(30)
        for tier in opened:
            tier.close()
