"""What a scoped prefix-cache reset costs against a full one, and how much warm cache it keeps.

A pool of `--blocks` cached blocks spread evenly over `--scopes` scopes (one LoRA adapter or salt each, as
an RL fleet with several policies or a multi-tenant fleet holds them). Alternately, `--repeats` times each:
the full reset (the baseline: everything cold) and a reset of one scope, each without and with KV events
recorded (a full reset records one AllBlocksCleared; a scoped one names every key it dropped). The JSON
under bench/results/ has each one's median time, the blocks it made unreachable and the share of the cache
left warm.

    python bench/scoped_reset.py            # 100k blocks, 8 scopes, 20 repeats
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parents[1] / "hack" / "lib"))  # benchkit
import benchkit  # noqa: E402
from kvpilot.daemon.engine.kv.block_pool import BlockPool  # noqa: E402
from kvpilot.daemon.engine.kv.cache_scope import CacheScope  # noqa: E402
from kvpilot.daemon.engine.kv.recorder import KVEventRecorder  # noqa: E402
from kvpilot.kv.block_keys import DEFAULT_KEYS, LoRAKey  # noqa: E402

RESULTS = Path(__file__).parent / "results"


def fill(pool: BlockPool, scopes: list[CacheScope]) -> None:
    """Every block of the pool cached, the same number in each scope."""
    blocks = pool.allocate(pool.num_blocks)
    per = pool.num_blocks // len(scopes)
    for s, scope in enumerate(scopes):
        index = pool.open_index(scope)
        for i, b in enumerate(blocks[s * per : (s + 1) * per]):
            pool.cache_block(b, index, DEFAULT_KEYS.hash_block(None, [s, i], None))
        pool.close_index(index)
    pool.free(blocks)


def measure(num_blocks: int, num_scopes: int, repeats: int) -> dict:
    scopes = [CacheScope(None, LoRAKey(f"policy-{i}", "0" * 64), None) for i in range(num_scopes)]
    modes = ("full", "scoped", "full_with_events", "scoped_with_events")
    runs: dict[str, list[tuple[float, int, int]]] = {m: [] for m in modes}
    pool = BlockPool(num_blocks)
    for _ in range(repeats):
        for mode in runs:
            pool.events = KVEventRecorder(16) if mode.endswith("_with_events") else None
            fill(pool, scopes)
            before = pool.num_cached_blocks
            start = time.perf_counter()
            if mode.startswith("full"):
                evicted = pool.reset()
            else:
                evicted = pool.reset_scopes(lambda s: s.lora is not None and s.lora.name == "policy-0")
            took = time.perf_counter() - start
            runs[mode].append((took, evicted, pool.num_cached_blocks))
            pool.release_retired()
            assert before == num_blocks // num_scopes * num_scopes
            pool.reset()  # the next fill starts empty
            pool.release_retired()
    out = {}
    for mode, rs in runs.items():
        out[mode] = {
            "median_ms": statistics.median(r[0] for r in rs) * 1e3,
            "max_ms": max(r[0] for r in rs) * 1e3,
            "evicted_blocks": rs[0][1],
            "warm_share_kept": rs[0][2] / (num_blocks // num_scopes * num_scopes),
        }
    out["scoped_vs_full_time"] = out["scoped"]["median_ms"] / out["full"]["median_ms"]
    out["scoped_vs_full_time_with_events"] = (
        out["scoped_with_events"]["median_ms"] / out["full_with_events"]["median_ms"]
    )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--blocks", type=int, default=100_000)
    ap.add_argument("--scopes", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=20)
    args = ap.parse_args()
    load_before = os.getloadavg()
    figures = measure(args.blocks, args.scopes, args.repeats)
    result = {
        **benchkit.header("scoped-reset", load_before),
        "config": {"blocks": args.blocks, "scopes": args.scopes, "repeats": args.repeats},
        "commit": benchkit.git_head(),
        **figures,
    }
    print(json.dumps(figures, indent=2))
    benchkit.write(benchkit.default_path(RESULTS, "scoped-reset"), result)


if __name__ == "__main__":
    main()
