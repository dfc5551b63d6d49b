"""Decode tokens/s of the engine and the share of memory bandwidth its decode steps reach.

A decode step of B requests must read every weight once and each request's K/V once; that many bytes
over the step's time is the bandwidth the step achieves, against the device's bandwidth measured here
(a large device-to-device copy, bytes read + written) and, on a known GPU, its datasheet figure
(bench/attention_kernels.py's table). What falls short of 100% is the step's overhead beyond moving bytes
(scheduling, launches, the sampler). For each batch size, B requests of `--context` random prompt
tokens decode `--max-tokens` tokens each through the engine (`bench/engine.py`'s `run_load`); the
median decode step (every request decoding) is reported. One JSON file under bench/results/.

    python bench/decode_bandwidth.py                      # the embedded model, bf16 on a GPU
    python bench/decode_bandwidth.py --batches 1 4 --context 128 --max-tokens 8   # a CPU smoke run
"""

from __future__ import annotations

import argparse
import math
import os
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.append(str(Path(__file__).resolve().parents[1] / "hack" / "lib"))  # benchkit

import benchkit
from kvpilot.daemon.engine.config import EngineConfig
from kvpilot.daemon.engine.engine import LLMEngine

RESULTS = Path(__file__).parent / "results"
HERE = Path(__file__).parent
run_load = benchkit.bench_module(HERE / "engine.py").run_load
datasheet_gbps = benchkit.bench_module(HERE / "attention_kernels.py")._datasheet


def copy_gbps(device: torch.device, nbytes: int = 1 << 30, repeats: int = 10) -> float:
    """Bytes read + written per second by a copy between two device tensors of `nbytes` (median)."""
    a = torch.empty(nbytes, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    times = []
    for _ in range(repeats + 1):  # the first warms up
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t = time.perf_counter()
        b.copy_(a)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t)
    return 2 * nbytes / statistics.median(times[1:]) / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--context", type=int, default=1024, help="prompt tokens of each request")
    ap.add_argument("--max-tokens", type=int, default=64, help="tokens each request decodes")
    ap.add_argument("--device", default="auto", help="torch device (auto: cuda if available, else cpu)")
    ap.add_argument("--dtype", default="auto", help="auto: float32 on CPU, bfloat16 on GPU")
    ap.add_argument("--output", type=Path, default=RESULTS / "decode-bandwidth.json")
    args = ap.parse_args()
    load_before = os.getloadavg()
    longest = args.context + args.max_tokens
    blocks = max(args.batches) * (longest // 16 + 2)
    engine = LLMEngine(
        EngineConfig(
            device=args.device,
            dtype=args.dtype,
            num_kv_blocks=blocks,
            max_num_seqs=max(args.batches),
            max_num_batched_tokens=max(2048, args.context),
            enable_prefix_caching=False,  # every request's K/V is its own: all of it is read each step
        )
    )
    dev = engine.device
    # every weight, wherever it is kept (panels in place of the linear weights on a one-thread CPU)
    weights = engine.runner.model.weights().values()
    weight_bytes = sum(math.prod(w.shape) * w.dtype.itemsize for w in weights)
    k, _ = engine.runner.kv_caches[0]
    kv_bytes_per_token = 2 * len(engine.runner.kv_caches) * k[0, 0].numel() * k.element_size()
    copy = copy_gbps(dev)
    datasheet = datasheet_gbps(torch.cuda.get_device_name(dev)) if dev.type == "cuda" else None
    rng = random.Random(0)
    run_load(engine, [[rng.randrange(1000, 40000) for _ in range(32)]], 4)  # warm-up: first-call allocations
    rows = []
    for batch in args.batches:
        prompts = [[rng.randrange(1000, 40000) for _ in range(args.context)] for _ in range(batch)]
        r = run_load(engine, prompts, args.max_tokens)
        step_s = r["decode_step_ms"] / 1e3
        # K/V read by the median decode step: every request's context, halfway through its decode
        moved = weight_bytes + batch * (args.context + args.max_tokens // 2) * kv_bytes_per_token
        row = {
            "batch": batch,
            "decode_step_ms": r["decode_step_ms"],
            "decode_tokens_per_s": batch / step_s,
            "end_to_end_tokens_per_s": r["tokens_per_s"],
            "bytes_per_step": moved,
            "achieved_gbps": moved / step_s / 1e9,
        }
        row["share_of_copy_bandwidth"] = row["achieved_gbps"] / copy
        if datasheet:
            row["share_of_datasheet_bandwidth"] = row["achieved_gbps"] / datasheet
        rows.append(row)
        print(
            f"batch {batch:4d}: decode step {r['decode_step_ms']:.2f} ms, {row['decode_tokens_per_s']:.0f} tok/s, "
            f"{row['achieved_gbps']:.1f} GB/s = {100 * row['share_of_copy_bandwidth']:.1f}% of copy bandwidth "
            f"({copy:.0f} GB/s)"
            + (f", {100 * row['share_of_datasheet_bandwidth']:.1f}% of datasheet" if datasheet else "")
        )
    engine.close()
    result = {
        **benchkit.header("decode_bandwidth", load_before),
        "rows": rows,
        "context": args.context,
        "max_tokens": args.max_tokens,
        "weight_bytes": weight_bytes,
        "kv_bytes_per_token": kv_bytes_per_token,
        "copy_bandwidth_gbps": copy,
        "datasheet_bandwidth_gbps": datasheet,
        "env": {
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
            "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
            "dtype": str(engine.dtype),
        },
    }
    benchkit.write(args.output, result)


if __name__ == "__main__":
    main()
