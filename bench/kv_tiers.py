"""The second KV tier: time-to-first-token of a long prefix recomputed, copied back from host memory, read
back from disk, and found in the pool, in one run; the bytes a block costs in each place; the copy
bandwidth between pool and host.

The pool (`num_kv_blocks`) holds one prompt of the longest length but not two. For each tier an engine
with only that tier runs, for each length: the prompt once cold (nothing cached: recompute), then
`--repeats` times: a flush prompt that fills the whole pool (so every block of the prompt is evicted into
the tier), the prompt again (its prefix copied back from the tier) and once more (a pool hit). Every
measured run is checked to have been served from where it claims (cached tokens, the tier's hit counter).

Disk reads are measured with the block files dropped from the page cache first (fsync, then
POSIX_FADV_DONTNEED), i.e. as reads from the device, and again with them in the page cache.

The copy bandwidth is `ModelRunner.read_blocks` (pool -> host) and `write_blocks` (host -> pool) of the
longest prompt's blocks, against a plain copy of the same bytes between one contiguous pool-side tensor
and one host tensor (pinned on CUDA: the PCIe bound as this machine reaches it) measured in the same run.

    python bench/kv_tiers.py                       # 1024 and 4096 tokens, CPU fp32, ~3 minutes on 2 cores
    python bench/kv_tiers.py --device cuda         # the same in bf16 on a GPU, copy bandwidth included
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.append(str(Path(__file__).resolve().parents[1] / "hack" / "lib"))  # benchkit

import benchkit
from kvpilot.daemon.engine.config import EngineConfig
from kvpilot.daemon.engine.engine import LLMEngine

RESULTS = Path(__file__).parent / "results"
engine_ttft = benchkit.bench_module(Path(__file__).with_name("engine.py")).engine_ttft
TIERS = ("host", "disk")
# Nominal one-direction bandwidth of a PCIe 5.0 x16 link (H100/H200 PCIe hosts), beside the measured one.
PCIE5_X16_GBPS = 63.0


def random_prompt(length: int, seed: int) -> list[int]:
    """Token ids that share no block with any other prompt of the run (a seed per prompt)."""
    rng = random.Random(seed)
    return [rng.randrange(1000, 40000) for _ in range(length)]


def sync(engine: LLMEngine) -> None:
    if engine.device.type == "cuda":
        torch.cuda.synchronize(engine.device)


def settle_disk(engine: LLMEngine, drop_page_cache: bool, timeout: float = 60.0) -> None:
    """Wait until the disk writer has written every evicted block (it runs off the engine's thread), then
    optionally drop the block files from the page cache so the next read comes from the device."""
    disk = engine.kv.offload.disk
    if not disk.flush(timeout):
        raise RuntimeError(f"the disk writer has not caught up after {timeout} s")
    engine.kv.offload.poll()
    if not drop_page_cache:
        return
    for p in disk.root.glob(f"gen-{disk.generation}/*.kv"):
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)  # only clean pages can be dropped
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def tier_hits(engine: LLMEngine, tier: str) -> int:
    return next(t.hit_tokens for t in engine.stats().offload if t.tier == tier)


def ttft_from(engine: LLMEngine, prompt: list[int], tier: str | None, expect_cached: int) -> float:
    """TTFT of `prompt`, checked to have been served as claimed: `expect_cached` tokens, all from `tier`
    (None: from the pool, or nothing cached)."""
    before = tier_hits(engine, tier) if tier else 0
    seconds, cached = engine_ttft(engine, prompt)
    from_tier = tier_hits(engine, tier) - before if tier else 0
    if cached != expect_cached or (tier and from_tier != cached):
        raise RuntimeError(
            f"{len(prompt)}-token prompt: {cached} tokens cached ({from_tier} from {tier}), "
            f"expected {expect_cached} from {tier or 'the pool'}: the run is not measuring what it says"
        )
    return seconds


def measure_tier(config: EngineConfig, tier: str, lengths: list[int], repeats: int, flush: list[int]) -> dict:
    """Per length: cold, tier and pool-hit TTFTs (seconds) in one engine whose only tier is `tier`."""
    engine = LLMEngine(config)
    bs = config.block_size
    out = {}
    try:
        for length in lengths:
            prompt = random_prompt(length, seed=length)
            full = (length - 1) // bs * bs  # the last token is always computed
            row: dict[str, list[float]] = {"cold": [ttft_from(engine, prompt, None, 0)], tier: [], "pool": []}
            if tier == "disk":
                row["disk_page_cache"] = []
            for r in range(repeats):
                engine_ttft(engine, flush)  # fills the pool: every block of `prompt` goes to the tier
                if tier == "disk":
                    # alternate device reads and page-cache reads, so that both see the same machine load
                    for where in ("disk", "disk_page_cache")[:: 1 if r % 2 == 0 else -1]:
                        settle_disk(engine, drop_page_cache=where == "disk")
                        row[where].append(ttft_from(engine, prompt, "disk", full))
                        row["pool"].append(ttft_from(engine, prompt, None, full))
                        engine_ttft(engine, flush)
                else:
                    row[tier].append(ttft_from(engine, prompt, tier, full))
                    row["pool"].append(ttft_from(engine, prompt, None, full))
            out[length] = row
        out["block_bytes"] = block_bytes(engine, tier)
        out["engine"] = {"device": str(engine.device), "dtype": str(engine.dtype)}
        if tier == "host":
            out["copy"] = copy_bandwidth(engine, max(lengths) // bs)
    finally:
        engine.close()
    return out


def block_bytes(engine: LLMEngine, tier: str) -> dict:
    """What one block costs: in the pool (its K and V in every layer), in the tier (the tier's own count,
    and for disk the file's size and the space the filesystem gave it)."""
    pool = block_bytes_of(engine)
    (stats,) = [t for t in engine.stats().offload if t.tier == tier]
    out = {"pool": pool, tier: stats.bytes // max(stats.blocks, 1)}
    if tier == "disk":
        disk = engine.kv.offload.disk
        f = next(disk.root.glob(f"gen-{disk.generation}/*.kv"))
        out["disk_file"] = f.stat().st_size
        out["disk_allocated"] = f.stat().st_blocks * 512
    return out


def copy_bandwidth(engine: LLMEngine, n_blocks: int, repeats: int = 5) -> dict:
    """GB/s of read_blocks (pool -> host) and write_blocks (host -> pool) of `n_blocks` blocks, and of a
    plain copy of the same bytes between contiguous tensors (pinned host memory on CUDA)."""
    runner, dev = engine.runner, engine.device
    ids = list(range(n_blocks))
    nbytes = n_blocks * block_bytes_of(engine)
    reads, writes, d2h, h2d = [], [], [], []
    src = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=dev.type == "cuda")
    for _ in range(repeats + 1):  # the first round warms allocators (pinned memory, the caching allocator)
        sync(engine)
        t = time.perf_counter()
        blocks = runner.read_blocks(ids)
        for b in blocks:
            b.wait()
        reads.append(time.perf_counter() - t)
        t = time.perf_counter()
        runner.write_blocks(ids, blocks)
        sync(engine)
        writes.append(time.perf_counter() - t)
        t = time.perf_counter()
        host.copy_(src, non_blocking=True)
        sync(engine)
        d2h.append(time.perf_counter() - t)
        t = time.perf_counter()
        src.copy_(host, non_blocking=True)
        sync(engine)
        h2d.append(time.perf_counter() - t)

    def gbps(times: list[float]) -> float:
        return nbytes / statistics.median(times[1:]) / 1e9

    out = {
        "blocks": n_blocks,
        "bytes": nbytes,
        "read_blocks_gbps": gbps(reads),
        "write_blocks_gbps": gbps(writes),
        "plain_d2h_gbps": gbps(d2h),
        "plain_h2d_gbps": gbps(h2d),
        "baseline": "pinned host <-> device copy of one contiguous tensor"
        if dev.type == "cuda"
        else "contiguous host memory copy (torch.Tensor.copy_)",
    }
    out["read_vs_plain"] = out["read_blocks_gbps"] / out["plain_d2h_gbps"]
    out["write_vs_plain"] = out["write_blocks_gbps"] / out["plain_h2d_gbps"]
    if dev.type == "cuda":
        out["pcie5_x16_nominal_gbps"] = PCIE5_X16_GBPS
    return out


def block_bytes_of(engine: LLMEngine) -> int:
    k, _ = engine.runner.kv_caches[0]
    return 2 * len(engine.runner.kv_caches) * k[0].numel() * k.element_size()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096])
    ap.add_argument("--repeats", type=int, default=2, help="tier and pool-hit runs per length and tier")
    ap.add_argument("--device", default="auto", help="torch device (auto: cuda if available, else cpu)")
    ap.add_argument("--dtype", default="auto", help="auto: float32 on CPU, bfloat16 on GPU")
    ap.add_argument("--disk-dir", type=Path, default=None, help="where the disk tier lives (a temporary dir)")
    ap.add_argument("--output", type=Path, default=RESULTS / "kv-tiers.json")
    args = ap.parse_args()
    load_before = os.getloadavg()
    bs = 16
    # One prompt of the longest length fits, two do not; the flush prompt takes every block (its last
    # token in the last block: a prompt must leave one token of the context for the completion).
    num_blocks = max(args.lengths) // bs + 16
    flush = random_prompt(num_blocks * bs - 1, seed=0)
    base = {
        "device": args.device,
        "dtype": args.dtype,
        "block_size": bs,
        "num_kv_blocks": num_blocks,
        "max_num_batched_tokens": max(args.lengths),
        "max_model_len": num_blocks * bs,
    }
    runs = {}
    with tempfile.TemporaryDirectory(prefix="kv-tiers-", dir=args.disk_dir) as tmp:
        runs["host"] = measure_tier(
            EngineConfig(**base, kv_offloading_size=1.0), "host", args.lengths, args.repeats, flush
        )
        runs["disk"] = measure_tier(
            EngineConfig(**base, kv_offloading_dir=tmp, kv_offloading_dir_size=2.0),
            "disk",
            args.lengths,
            args.repeats,
            flush,
        )
        filesystem = os.statvfs(tmp)
    med = statistics.median
    rows = []
    for length in args.lengths:
        h, d = runs["host"][length], runs["disk"][length]
        r = {
            "prompt_tokens": length,
            "cached_tokens": (length - 1) // bs * bs,
            "cold_ttft_s": med(h["cold"] + d["cold"]),
            "host_ttft_s": med(h["host"]),
            "disk_ttft_s": med(d["disk"]),
            "disk_page_cache_ttft_s": med(d["disk_page_cache"]),
            "pool_hit_ttft_s": med(h["pool"] + d["pool"]),
            "samples_s": {"host_engine": h, "disk_engine": d},
        }
        for tier in ("host", "disk", "disk_page_cache"):
            r[f"{tier}_vs_recompute"] = r[f"{tier}_ttft_s"] / r["cold_ttft_s"]
            r[f"{tier}_vs_pool_hit"] = r[f"{tier}_ttft_s"] / r["pool_hit_ttft_s"]
        rows.append(r)
    result = {
        **benchkit.header("kv_tiers", load_before),
        "runs": rows,
        "block_bytes": {**runs["host"]["block_bytes"], **runs["disk"]["block_bytes"]},
        "copy": runs["host"]["copy"],
        "config": {**base, "repeats": args.repeats, "flush_prompt_tokens": len(flush)},
        "env": {
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
            "cpu": platform.processor(),
            **runs["host"]["engine"],
            "disk_block_size": filesystem.f_bsize,
        },
    }
    print(
        f"{'tokens':>6} {'recompute':>10} {'host':>8} {'disk':>8} {'disk(pc)':>9} {'pool hit':>9}  host/rec disk/rec  host/pool disk/pool"
    )
    for r in rows:
        print(
            f"{r['prompt_tokens']:6d} {r['cold_ttft_s']:9.3f}s {r['host_ttft_s']:7.3f}s {r['disk_ttft_s']:7.3f}s "
            f"{r['disk_page_cache_ttft_s']:8.3f}s {r['pool_hit_ttft_s']:8.3f}s  {r['host_vs_recompute']:8.3f} "
            f"{r['disk_vs_recompute']:8.3f}  {r['host_vs_pool_hit']:9.2f} {r['disk_vs_pool_hit']:9.2f}"
        )
    b, c = result["block_bytes"], result["copy"]
    print(
        f"one block: pool {b['pool']} B, host {b['host']} B, disk file {b['disk_file']} B ({b['disk_allocated']} allocated)"
    )
    print(
        f"copy of {c['blocks']} blocks: read_blocks {c['read_blocks_gbps']:.2f} GB/s ({c['read_vs_plain']:.2f} of plain), "
        f"write_blocks {c['write_blocks_gbps']:.2f} GB/s ({c['write_vs_plain']:.2f} of plain)"
    )
    benchkit.write(args.output, result)


if __name__ == "__main__":
    main()
