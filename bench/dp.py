"""Data parallel vs one engine: `kvpilot serve --data-parallel-size 1` and `2` on the shared-prefix chat
load, one torch thread per rank, in one run; output tok/s and their ratio to JSON.

On a 2-core machine DP=1 runs one engine with one thread (the other core serves HTTP, as `serve` does
by default) and DP=2 runs two engines pinned to one core each. The ratio is the point; the absolute
numbers depend on what else the machine runs, so the load average is recorded beside them.

    .venv/bin/python bench/dp.py                                   # DP 1 2 2 1, 16 clients, 32 tokens
    .venv/bin/python bench/dp.py --concurrency 8 32 --max-tokens 64 --sizes 1 2 4 2 1
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parents[1] / "hack" / "lib"))  # benchkit, devcluster

import benchkit
from kvpilot.cli.loadgen import sweep

HERE = Path(__file__).resolve().parent

MODEL = "SmolLM2-135M-Instruct"


def bench_size(size: int, args: argparse.Namespace, logdir: Path) -> list[dict]:
    logdir.mkdir()
    flags = [
        "--data-parallel-size",
        str(size),
        "--cpu-threads",
        "1",
        "--max-num-seqs",
        str(max(args.concurrency)),
    ]
    with benchkit.kvpilot_serve(logdir / f"dp{size}.log", 900, *flags) as url:
        runs = sweep(
            url,
            MODEL,
            f"kvpilot-dp{size}",
            args.concurrency,
            rounds=args.rounds,
            min_requests=args.min_requests,
            max_tokens=args.max_tokens,
        )
    return [asdict(r) for r in runs]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--sizes",
        type=int,
        nargs="+",
        default=[1, 2, 2, 1],
        help="data-parallel sizes in run order, repeats averaged (first: baseline)",
    )
    p.add_argument("--concurrency", type=int, nargs="+", default=[16])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--min-requests", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--output", type=Path, default=None)
    args = p.parse_args()
    load_before = os.getloadavg()
    rounds: list[tuple[int, list[dict]]] = []  # a size may repeat (1 2 2 1): drift on a shared machine
    with tempfile.TemporaryDirectory(prefix="kvpilot-bench-dp-") as tmp:
        for i, size in enumerate(args.sizes):
            print(f"--- data-parallel-size {size}", flush=True)
            rounds.append((size, bench_size(size, args, Path(tmp) / str(i))))
    tok_s: dict[int, list[float]] = {}
    for size, runs in rounds:  # mean over the rounds of a size, per concurrency level
        tok_s.setdefault(size, [])
        tok_s[size].append([r["output_tokens_per_s"] for r in runs])
    mean = {size: [sum(col) / len(col) for col in zip(*per)] for size, per in tok_s.items()}
    base = args.sizes[0]
    ratios = {
        str(size): [round(v / b, 3) if b else None for v, b in zip(values, mean[base])]
        for size, values in mean.items()
    }
    out = {
        **benchkit.header("dp", load_before),
        "git": subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=HERE
        ).stdout.strip(),
        "settings": {k: v for k, v in vars(args).items() if k != "output"},
        "tokens_per_s_ratio_vs_dp" + str(base): ratios,
        "mean_tokens_per_s": {str(k): v for k, v in mean.items()},
        "rounds": [{"data_parallel_size": size, "runs": runs} for size, runs in rounds],
    }
    benchkit.write(args.output or benchkit.default_path(HERE / "results", "dp"), out)
    print(json.dumps(ratios))
    return 0


if __name__ == "__main__":
    sys.exit(main())
