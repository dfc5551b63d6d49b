"""The compiled step against the eager one: decode tokens/s and tokens per CPU second at batch 1, 16 and
64, and what compiling costs (cold: an empty compile cache; warm: the cache a first compile left); and
the eager step's packed linear weights (on the CPU, kernels/packed_linear.py) against F.linear.

Engines in this process on the embedded model, one at -O0 (eager), one at -O1 (torch.compile, inductor;
on CUDA -O2 also replays CUDA graphs) and, on the CPU, the eager one with --packed-linears and one at -O0
without ("dense"): for
each batch size, B requests of random prompts (no prefix hit) decode with ignore_eos, and only the steps
where every request decodes count. The engines take turns, `--repeats` times, so that all see the same
machine load; the ratios are of medians. Greedy outputs are compared token by token with the eager one's.

    .venv/bin/python bench/compile.py                  # batch 1, 16, 64; 2 repeats
    .venv/bin/python bench/compile.py --batches 1 4 --tokens 8 --repeats 1   # a quick look
    .venv/bin/python bench/compile.py --batches 1 8 16 --no-compiled   # packed linears only (a minute)

JSON to bench/results/compile-<UTC time>.json (--out to choose).
"""

from __future__ import annotations

import argparse
import os
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
from kvpilot.daemon.engine.request import SamplingParams

RESULTS = Path(__file__).parent / "results"
PROMPT_TOKENS = 64


def engine(level: int, device: str, packed_linears: bool = False) -> tuple[LLMEngine, float]:
    """An engine at `level` and the seconds its first step took (a compiled one compiles there)."""
    config = EngineConfig(
        device=device, compilation_config=str(level), num_kv_blocks=1024, packed_linears=packed_linears
    )
    eng = LLMEngine(config)
    started = time.perf_counter()
    eng.generate([[1, 2, 3, 4]], SamplingParams(max_tokens=2))
    return eng, time.perf_counter() - started


def decode(eng: LLMEngine, prompts: list[list[int]], tokens: int) -> dict:
    """Run `prompts` to `tokens` new tokens each; time the steps where every request decodes."""
    ids = [f"b{time.monotonic_ns()}-{i}" for i in range(len(prompts))]
    for rid, p in zip(ids, prompts):
        eng.add_request(rid, p, SamplingParams(max_tokens=tokens, ignore_eos=True))
    wall = cpu = 0.0
    steps, out = 0, {rid: [] for rid in ids}
    while eng.has_unfinished_requests():
        s = eng.scheduler
        decoding = not s.waiting and all(r.num_tokens - r.num_computed_tokens == 1 for r in s.running)
        t0, c0 = time.perf_counter(), time.process_time()
        for o in eng.step():
            out[o.request_id].extend(o.new_token_ids)
        if decoding and len(s.running) == len(prompts):
            wall += time.perf_counter() - t0
            cpu += time.process_time() - c0
            steps += 1
    eng.reset_prefix_cache()
    made = steps * len(prompts)
    return {"tokens_per_s": made / wall, "tokens_per_cpu_s": made / cpu, "steps": steps, "out": out}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--tokens", type=int, default=24, help="new tokens per request")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--no-compiled", action="store_true", help="leave the compiled engine out")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    load_before = os.getloadavg()
    compiled_level = 2 if EngineConfig(device=args.device).torch_device().type == "cuda" else 1
    eager, eager_first = engine(0, args.device, packed_linears=True)
    sides = {"eager": eager}
    cold = warm = None
    if not args.no_compiled:
        with tempfile.TemporaryDirectory() as cache:
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache  # cold: nothing compiled before this run
            sides["compiled"], cold = engine(compiled_level, args.device)
            _, warm = engine(compiled_level, args.device)  # a new engine: traced again, its kernels cached
    if eager.device.type == "cpu":
        sides["dense"], _ = engine(0, args.device, packed_linears=False)
    rng = random.Random(0)
    rows = {}
    for b in args.batches:
        prompts = [[rng.randrange(100, 40000) for _ in range(PROMPT_TOKENS)] for _ in range(b)]
        runs: dict[str, list[dict]] = {side: [] for side in sides}
        for _ in range(args.repeats):
            for side, eng in sides.items():
                runs[side].append(decode(eng, prompts, args.tokens))

        def med(side: str, key: str) -> float:
            return statistics.median(r[key] for r in runs[side])  # noqa: B023 - used at once

        row: dict = {
            side: {
                "tokens_per_s": med(side, "tokens_per_s"),
                "tokens_per_cpu_s": med(side, "tokens_per_cpu_s"),
            }
            for side in runs
        }
        eager_out = list(runs["eager"][0]["out"].values())
        # (the ratios' other side, their names in the JSON)
        for other, base, name in (("compiled", "eager", "compiled"), ("eager", "dense", "packed")):
            if other in runs and base in runs:
                row[f"{name}_speedup"] = med(other, "tokens_per_s") / med(base, "tokens_per_s")
                row[f"{name}_cpu_ratio"] = med(other, "tokens_per_cpu_s") / med(base, "tokens_per_cpu_s")
                not_eager = base if other == "eager" else other
                row[f"{name}_same_greedy_tokens"] = list(runs[not_eager][0]["out"].values()) == eager_out
                print(
                    f"batch {b}: {other} {row[other]['tokens_per_s']:.1f} tok/s against {base} "
                    f"{row[base]['tokens_per_s']:.1f} ({row[f'{name}_speedup']:.2f}x; per CPU second "
                    f"{row[f'{name}_cpu_ratio']:.2f}x), same tokens: {row[f'{name}_same_greedy_tokens']}"
                )
        rows[str(b)] = row
    doc = {
        **benchkit.header("compile", load_before),
        "device": str(eager.device),
        "threads": torch.get_num_threads(),
        "compiled_level": compiled_level,
        "first_step_s": {"eager": eager_first, "compiled_cold_cache": cold, "compiled_warm_cache": warm},
        "tokens_per_request": args.tokens,
        "batches": rows,
        "commit": benchkit.git_head(),
    }
    if cold is not None:
        print(f"first step: eager {eager_first:.1f} s, compiled {cold:.1f} s cold, {warm:.1f} s warm")
    benchkit.write(args.out or benchkit.default_path(RESULTS, "compile"), doc)


if __name__ == "__main__":
    main()
