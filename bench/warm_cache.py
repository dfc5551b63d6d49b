"""How much a warm prefix cache skews time-to-first-token: the same prompt cold (right after a reset) and warm.

This is why a benchmark must reset the cache before each run: a prompt that an earlier run left in the cache
answers its first token after one block of prefill instead of the whole prompt. For each prompt length the
engine is reset, the prompt runs once cold, then again warm (every full block cached); the ratio is cold / warm
TTFT, both measured in this process one after the other. One JSON file under bench/results/.

    python bench/warm_cache.py                         # 256, 1024 and 4096 prompt tokens, 3 repeats each
    python bench/warm_cache.py --lengths 512 2048 --repeats 5
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
from pathlib import Path

import torch

sys.path.append(str(Path(__file__).resolve().parents[1] / "hack" / "lib"))  # benchkit

import benchkit
from kvpilot.daemon.engine.config import EngineConfig
from kvpilot.daemon.engine.engine import LLMEngine
from kvpilot.daemon.engine.request import SamplingParams

RESULTS = Path(__file__).parent / "results"
engine_ttft = benchkit.bench_module(Path(__file__).with_name("engine.py")).engine_ttft
TEXT = (
    "Every replica keeps a prefix cache of attention keys and values, so prompts that share their beginning "
    "are computed once; benchmarks flush it before every run so that each run starts cold. "
)


def prompt_of(engine: LLMEngine, length: int) -> list[int]:
    ids = engine.tokenizer(TEXT)["input_ids"]
    return (ids * (length // len(ids) + 1))[:length]


def measure(engine: LLMEngine, length: int, repeats: int) -> dict:
    prompt = prompt_of(engine, length)
    cold, warm, cached = [], [], 0
    for _ in range(repeats):
        engine.reset_prefix_cache()
        cold.append(engine_ttft(engine, prompt)[0])
        t, cached = engine_ttft(engine, prompt)
        warm.append(t)
    c, w = statistics.median(cold), statistics.median(warm)
    return {
        "prompt_tokens": length,
        "cached_tokens_warm": cached,
        "cold_ttft_s": c,
        "warm_ttft_s": w,
        "cold_vs_warm": c / w,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", type=int, nargs="+", default=[256, 1024, 4096])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--output", type=Path, default=RESULTS / "warm-cache.json")
    args = ap.parse_args()
    engine = LLMEngine(
        EngineConfig(num_kv_blocks=max(args.lengths) // 16 + 64, max_num_batched_tokens=max(args.lengths))
    )
    engine.generate([prompt_of(engine, 32)], SamplingParams(max_tokens=2))  # warm-up: first-call allocations
    rows = []
    for length in args.lengths:
        rows.append(measure(engine, length, args.repeats))
        r = rows[-1]
        print(
            f"{length:6d} prompt tokens: cold {r['cold_ttft_s']:.3f} s, warm {r['warm_ttft_s']:.3f} s "
            f"({r['cached_tokens_warm']} cached): warm cache makes TTFT {r['cold_vs_warm']:.1f}x faster"
        )
    result = {
        "runs": rows,
        "repeats": args.repeats,
        "env": {
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
            "cpu": platform.processor(),
            "device": str(engine.device),
            "dtype": str(engine.dtype),
        },
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
