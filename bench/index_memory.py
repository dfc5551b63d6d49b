"""Bytes the router's prefix index keeps per block hash, measured with tracemalloc (issue 21's bound: 120 B
at 1M hashes).

For each size, N random 32-byte block hashes (as a pod's BlockStored events carry them) are stored for one
holder, then the same N for a second holder (a prefix cached on two pods), and the memory the index holds
is divided by the hashes stored. In the same run, the same hashes go into the layout the index had before
(a set of hashes per holder plus a set of holders per hash) for comparison. One JSON file under
bench/results/.

    python bench/index_memory.py                    # 10k, 100k and 1M hashes
    python bench/index_memory.py --sizes 1000000
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
import tracemalloc
from pathlib import Path

from kvpilot.router.kv.index import MAX_BLOCKS_PER_HOLDER, PrefixIndex

RESULTS = Path(__file__).parent / "results"


def _traced(build) -> tuple[object, int]:  # noqa: ANN001
    """What `build()` leaves allocated, in bytes (the object it returns is kept alive meanwhile)."""
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    obj = build()
    held = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    return obj, held


def _fresh(keys: list[bytes]) -> list[bytes]:
    """Copies, as each pod's decoded events hold their own bytes objects."""
    return [bytes(bytearray(k)) for k in keys]


def measure(n: int) -> dict:
    keys = [os.urandom(32) for _ in range(n)]

    def index_of(holders: int) -> PrefixIndex:
        index = PrefixIndex()
        for h in range(holders):
            index.set_capacity(h, min(n, MAX_BLOCKS_PER_HOLDER))
            index.store(h, _fresh(keys))  # the decoded hashes are freed once stored, as in the router
        return index

    def before_of(holders: int) -> tuple[dict, dict]:
        by_holder: dict[int, set[bytes]] = {}
        by_key: dict[bytes, set[int]] = {}
        for h in range(holders):
            held = by_holder.setdefault(h, set())
            for k in _fresh(keys):
                held.add(k)
                by_key.setdefault(k, set()).add(h)
        return by_holder, by_key

    row: dict = {"hashes": n}
    for holders in (1, 2):
        start = time.perf_counter()
        index, held = _traced(lambda: index_of(holders))  # noqa: B023 - called at once
        row[f"store_s_{holders}_holder"] = round(time.perf_counter() - start, 3)
        assert index.num_blocks(0) == n
        row[f"bytes_per_hash_{holders}_holder"] = round(held / (n * holders), 1)
        del index
        _, held = _traced(lambda: before_of(holders))  # noqa: B023
        row[f"before_bytes_per_hash_{holders}_holder"] = round(held / (n * holders), 1)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[10_000, 100_000, 1_000_000])
    ap.add_argument("--output", type=Path, default=RESULTS / "index-memory.json")
    args = ap.parse_args()
    rows = []
    for n in args.sizes:
        rows.append(measure(n))
        r = rows[-1]
        print(
            f"{n:9d} hashes: {r['bytes_per_hash_1_holder']} B per hash (one holder), "
            f"{r['bytes_per_hash_2_holder']} B (two); before: {r['before_bytes_per_hash_1_holder']} B, "
            f"{r['before_bytes_per_hash_2_holder']} B"
        )
    result = {
        "runs": rows,
        "bound_bytes_per_hash": 120,
        "env": {"python": sys.version.split()[0], "machine": platform.machine()},
        "date": time.strftime("%Y-%m-%d", time.gmtime()),
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
