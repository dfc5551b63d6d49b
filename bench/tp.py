"""Tensor parallel step time: the same batch on `--tensor-parallel-size` 1 and N, one torch thread per
shard, in one run; mean prefill and decode step times and their ratio to TP=1, as JSON.

The embedded SmolLM2-135M has 9 attention heads and 3 KV heads, so N = 3 (2 does not divide them).
Each size runs in its own process (a process joins one torch.distributed group in its life).

    .venv/bin/python bench/tp.py                     # TP 1 vs 3, 8 prompts, 32 decode steps
    .venv/bin/python bench/tp.py --sizes 1 3 --batch 16 --model /models/llama
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parents[1] / "hack" / "lib"))  # benchkit, devcluster

import benchkit

HERE = Path(__file__).resolve().parent


def measure(model: str | None, tp: int, batch: int, steps: int) -> dict:
    """In this process: build the engine, prefill `batch` prompts, then time `steps` decode steps."""
    from kvpilot.daemon.engine.config import EngineConfig
    from kvpilot.daemon.engine.engine import LLMEngine
    from kvpilot.daemon.engine.request import SamplingParams

    engine = LLMEngine(EngineConfig(model=model, tensor_parallel_size=tp, cpu_threads=1, num_kv_blocks=512))
    params = SamplingParams(max_tokens=steps + 1, temperature=0, ignore_eos=True)
    for i in range(batch):
        engine.add_request(
            f"r{i}", engine.tokenizer.encode(f"Request {i}: tell me about the number {i * 7}."), params
        )
    t = time.perf_counter()
    engine.step()  # every prompt fits one prefill step
    prefill = time.perf_counter() - t
    t = time.perf_counter()
    for _ in range(steps):
        engine.step()
    return {"tp": tp, "prefill_step_s": prefill, "decode_step_s": (time.perf_counter() - t) / steps}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="checkpoint directory (default: the embedded model)")
    p.add_argument(
        "--sizes", type=int, nargs="+", default=[1, 3], help="tensor-parallel sizes (first: baseline)"
    )
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--output", type=Path, default=None)
    p.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child is not None:
        print(json.dumps(measure(args.model, args.child, args.batch, args.steps)))
        return 0
    load_before = os.getloadavg()
    rows = []
    for tp in args.sizes:
        cmd = [
            sys.executable,
            __file__,
            "--child",
            str(tp),
            "--batch",
            str(args.batch),
            "--steps",
            str(args.steps),
        ]
        if args.model:
            cmd += ["--model", args.model]
        done = subprocess.run(cmd, capture_output=True, text=True, check=True)
        rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
        print(rows[-1], flush=True)
    base = rows[0]["decode_step_s"]
    out = {
        **benchkit.header("tp", load_before),
        "settings": {k: v for k, v in vars(args).items() if k not in ("output", "child")},
        "decode_step_ratio_vs_tp" + str(args.sizes[0]): {
            str(r["tp"]): round(r["decode_step_s"] / base, 3) for r in rows
        },
        "runs": rows,
    }
    benchkit.write(args.output or benchkit.default_path(HERE / "results", "tp"), out)
    print(json.dumps(out["decode_step_ratio_vs_tp" + str(args.sizes[0])]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
