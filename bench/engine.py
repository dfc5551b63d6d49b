"""Engine benchmark: the shared-prefix load through kvpilot and through transformers, TTFT cases, reset cost.

One run, one JSON file under bench/results/. Ratios are against baselines measured in the same run.

    python bench/engine.py                # the default load (16 requests x ~300 tokens, 64 new)
    python bench/engine.py --quick        # a smaller load for a smoke run
    python bench/engine.py --against ../main   # also: this checkout vs another one, alternating runs

`--against DIR` runs the load in two resident worker processes, one per checkout (each with its own
`.venv`), alternately, so that both see the same machine load; it reports each side's tok/s and
median decode step (a step where every request decodes one token) and their ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from kvpilot.daemon.engine.config import EngineConfig
from kvpilot.daemon.engine.engine import LLMEngine
from kvpilot.daemon.engine.kv.block_pool import BlockPool
from kvpilot.daemon.engine.kv.cache_scope import CacheScope
from kvpilot.daemon.engine.request import SamplingParams
from kvpilot.kv.block_keys import DEFAULT_KEYS

RESULTS = Path(__file__).parent / "results"

SYSTEM = (
    "You are the on-call assistant of an inference platform team. The team runs many replicas of small "
    "language models on Kubernetes. Every replica keeps a prefix cache of attention keys and values, so "
    "prompts that share their beginning are computed once. Benchmarks flush these caches before every "
    "run so that each run starts cold and measures what a new user would see; training pipelines flush "
    "them after each weight update so that no stale values computed by the old weights are ever reused. "
    "When you answer, be brief, precise and friendly. Prefer short sentences. Never invent numbers; if a "
    "number is needed and you do not know it, say so. Use plain words rather than jargon, explain any "
    "acronym the first time it appears, and keep every answer under one hundred words unless asked for "
    "more. If a question is ambiguous, state the reading you chose before answering it. The platform "
    "has three parts: a node-local inference daemon that serves an OpenAI-compatible API over a paged "
    "key-value cache, an operator with two custom resources that deploys the daemons and fans cache "
    "resets out to every replica, and a command line tool for people. Operators of the platform care "
    "about honest answers: a reset that failed must never be reported as a success, and a replica that "
    "could not be reached must be named, with the reason, in the status of the reset that missed it."
)
QUESTIONS = [
    "What is a prefix cache?",
    "Why flush caches between runs?",
    "What is time to first token?",
    "How does paged attention work?",
    "What is continuous batching?",
    "Why is decode memory bound?",
    "What is a KV block?",
    "What does preemption mean here?",
    "Why use bf16 on GPUs?",
    "What is an epoch?",
    "What does a reset return?",
    "What is chunked prefill?",
    "Why is LRU eviction used?",
    "What is a cache salt?",
    "What is an operator?",
    "What is a DaemonSet?",
]


def chat(tokenizer, question: str) -> list[int]:  # noqa: ANN001
    ids = tokenizer.apply_chat_template(
        [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
        add_generation_prompt=True,
        tokenize=True,
    )
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def run_kvpilot(engine: LLMEngine, prompts: list[list[int]], max_tokens: int) -> dict:
    engine.reset_prefix_cache()
    before = engine.stats()
    load = run_load(engine, prompts, max_tokens)
    after = engine.stats()
    return {
        **load,
        "prompt_tokens": sum(len(p) for p in prompts),
        "cache_hit_tokens": after.hit_tokens - before.hit_tokens,
    }


def run_load(engine: LLMEngine, prompts: list[list[int]], max_tokens: int) -> dict:
    """Run the load step by step; a step where every request decodes one token is a decode step."""
    ids = [f"load-{time.monotonic_ns()}-{i}" for i in range(len(prompts))]
    for rid, prompt in zip(ids, prompts):
        engine.add_request(rid, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    tokens, decode_steps = 0, []
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        s = engine.scheduler
        decode_only = not s.waiting and all(r.num_tokens - r.num_computed_tokens == 1 for r in s.running)
        t0 = time.perf_counter()
        tokens += len(engine.step())
        if decode_only:
            decode_steps.append(time.perf_counter() - t0)
    secs = time.perf_counter() - start
    return {
        "seconds": secs,
        "output_tokens": tokens,
        "tokens_per_s": tokens / secs,
        "decode_steps": len(decode_steps),
        "decode_step_ms": statistics.median(decode_steps) * 1e3 if decode_steps else None,
    }


def worker() -> None:
    """`--worker`: the other side of `--against`. This file runs under the other checkout's python and
    code, so it only uses the engine API that every checkout since the daemon/engine split has.
    stdin: one JSON line {"prompts", "max_tokens", "num_kv_blocks"}, then a line per run wanted."""
    job = json.loads(sys.stdin.readline())
    engine = LLMEngine(EngineConfig(num_kv_blocks=job["num_kv_blocks"]))
    engine.generate([job["prompts"][0]], SamplingParams(max_tokens=2))  # warm-up
    print(json.dumps({"ready": True, "threads": torch.get_num_threads()}), flush=True)
    for _ in sys.stdin:
        engine.reset_prefix_cache()
        print(json.dumps(run_load(engine, job["prompts"], job["max_tokens"])), flush=True)


def run_transformers(model, prompts: list[list[int]], max_tokens: int, sharing: bool) -> dict:  # noqa: ANN001
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    gen = GenerationConfig(max_new_tokens=max_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
    cb = ContinuousBatchingConfig(
        allow_block_sharing=sharing, page_size=16, num_blocks=1024, max_batch_tokens=2048
    )
    start = time.perf_counter()
    out = model.generate_batch(prompts, generation_config=gen, continuous_batching_config=cb, warmup=False)
    secs = time.perf_counter() - start
    tokens = sum(len(o.generated_tokens) for o in out.values())
    return {"seconds": secs, "output_tokens": tokens, "tokens_per_s": tokens / secs, "block_sharing": sharing}


def engine_ttft(engine: LLMEngine, prompt: list[int]) -> tuple[float, int]:
    """Seconds until the first token of one request running alone in `engine`, and its cached prompt tokens."""
    engine.add_request("ttft", prompt, SamplingParams(max_tokens=1))
    start = time.perf_counter()
    cached = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            cached = out.num_cached_tokens
    return time.perf_counter() - start, cached


def ttft_cases(engine: LLMEngine, tokenizer, repeats: int) -> dict:  # noqa: ANN001
    long_prompt = chat(tokenizer, "Summarise the rules above in one line.")
    new_suffix = chat(tokenizer, "Which rule matters most, and why?")
    suffix_alone = tokenizer("Which rule matters most, and why?")["input_ids"]
    cases: dict[str, list[float]] = {
        "cold_long_prompt": [],
        "cached_prefix_new_suffix": [],
        "suffix_alone": [],
        "right_after_reset": [],
    }
    cached: dict[str, int] = {}
    for _ in range(repeats):
        engine.reset_prefix_cache()
        t, cached["cold_long_prompt"] = engine_ttft(engine, long_prompt)
        cases["cold_long_prompt"].append(t)
        t, cached["cached_prefix_new_suffix"] = engine_ttft(engine, new_suffix)
        cases["cached_prefix_new_suffix"].append(t)
        t, cached["suffix_alone"] = engine_ttft(engine, suffix_alone)
        cases["suffix_alone"].append(t)
        engine.reset_prefix_cache()
        t, cached["right_after_reset"] = engine_ttft(engine, new_suffix)
        cases["right_after_reset"].append(t)
    med = {k: statistics.median(v) for k, v in cases.items()}
    return {
        "median_seconds": med,
        "cached_tokens": cached,
        "prompt_tokens": {
            "long": len(long_prompt),
            "new_suffix": len(new_suffix),
            "suffix_alone": len(suffix_alone),
        },
        "cached_prefix_vs_suffix_alone": med["cached_prefix_new_suffix"] / med["suffix_alone"],
        "cold_vs_cached_prefix": med["cold_long_prompt"] / med["cached_prefix_new_suffix"],
    }


class Worker:
    """A resident worker process running the load on one checkout's code (its .venv, its sources)."""

    def __init__(self, checkout: Path, job: dict) -> None:
        python = checkout / ".venv" / "bin" / "python"
        env = dict(os.environ, PYTHONSAFEPATH="1")
        self.proc = subprocess.Popen(
            [str(python), str(Path(__file__).resolve()), "--worker"],
            cwd=checkout,
            env=env,
            text=True,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
        )
        self.proc.stdin.write(json.dumps(job) + "\n")
        self.proc.stdin.flush()
        self.ready = self._reply()

    def run(self) -> dict:
        self.proc.stdin.write("run\n")
        self.proc.stdin.flush()
        return self._reply()

    def _reply(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"worker exited with {self.proc.wait()}")
        return json.loads(line)

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(60)


def against(checkout: Path, prompts: list[list[int]], max_tokens: int, rounds: int) -> dict:
    """This checkout vs `checkout` on the same load, runs alternating between the two."""
    job = {"prompts": prompts, "max_tokens": max_tokens, "num_kv_blocks": 1024}
    sides = {"this": Worker(Path(__file__).resolve().parent.parent, job), "base": Worker(checkout, job)}
    runs: dict[str, list[dict]] = {name: [] for name in sides}
    try:
        for _ in range(rounds):
            for name, worker in sides.items():
                runs[name].append(worker.run())
                print(f"  {name}: {_fmt(runs[name][-1])}")
    finally:
        for worker in sides.values():
            worker.close()
    med = {
        name: {
            "tokens_per_s": statistics.median(r["tokens_per_s"] for r in rs),
            "decode_step_ms": statistics.median(r["decode_step_ms"] for r in rs),
        }
        for name, rs in runs.items()
    }
    return {
        "base_checkout": str(checkout.resolve()),
        "base_commit": _git_head(checkout),
        "this_commit": _git_head(Path(__file__).resolve().parent.parent),
        "runs": runs,
        "median": med,
        "tokens_per_s_ratio": med["this"]["tokens_per_s"] / med["base"]["tokens_per_s"],
        "decode_step_speedup": med["base"]["decode_step_ms"] / med["this"]["decode_step_ms"],
    }


def _git_head(checkout: Path) -> str | None:
    proc = subprocess.run(
        ["git", "-C", str(checkout), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    )
    dirty = subprocess.run(
        ["git", "-C", str(checkout), "status", "--porcelain", "-uno"], capture_output=True, text=True
    )
    return (
        (proc.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")) if proc.returncode == 0 else None
    )


def reset_latency(num_blocks: int, repeats: int = 20) -> dict:
    """A reset of a pool whose `num_blocks` blocks are all cached, and (the baseline) freeing the old index
    at once, as an eager reset would before it answers; kvpilot's pool frees it after the reply."""
    pool = BlockPool(num_blocks)
    times, frees = [], []
    for _ in range(repeats):
        blocks = pool.allocate(num_blocks)
        index = pool.open_index(CacheScope(None, None, None))
        for i, b in enumerate(blocks):
            pool.cache_block(b, index, DEFAULT_KEYS.hash_block(None, [i], None))
        pool.free(blocks)
        start = time.perf_counter()
        evicted = pool.reset()
        times.append(time.perf_counter() - start)
        assert evicted == num_blocks
        start = time.perf_counter()
        pool.release_retired()
        frees.append(time.perf_counter() - start)
    return {
        "cached_blocks": num_blocks,
        "median_ms": statistics.median(times) * 1e3,
        "max_ms": max(times) * 1e3,
        "free_old_index_median_ms": statistics.median(frees) * 1e3,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--ttft-repeats", type=int, default=3)
    ap.add_argument("--skip-transformers", action="store_true")
    ap.add_argument("--quick", action="store_true", help="4 requests x 16 tokens, one TTFT repeat")
    ap.add_argument("--against", type=Path, help="another checkout (with its .venv) to compare this one with")
    ap.add_argument("--against-rounds", type=int, default=3, help="runs per side with --against")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--output", type=Path, default=RESULTS / "engine.json")
    args = ap.parse_args()
    if args.worker:
        return worker()
    if args.quick:
        args.requests, args.max_tokens, args.ttft_repeats = 4, 16, 1

    engine = LLMEngine(EngineConfig(num_kv_blocks=4096))
    tok = engine.tokenizer
    prompts = [chat(tok, QUESTIONS[i % len(QUESTIONS)]) for i in range(args.requests)]
    engine.generate([prompts[0]], SamplingParams(max_tokens=2))  # warm-up: first-call allocations

    print(
        f"load: {len(prompts)} requests, prompts {min(map(len, prompts))}-{max(map(len, prompts))} tokens, "
        f"{args.max_tokens} new tokens each"
    )
    results: dict = {
        "load": {
            "requests": len(prompts),
            "prompt_tokens": [len(p) for p in prompts],
            "max_tokens": args.max_tokens,
        }
    }
    results["kvpilot_prefix_caching"] = run_kvpilot(engine, prompts, args.max_tokens)
    print("kvpilot, prefix caching on :", _fmt(results["kvpilot_prefix_caching"]))
    engine.kv.enable_prefix_caching = False
    results["kvpilot_no_prefix_caching"] = run_kvpilot(engine, prompts, args.max_tokens)
    engine.kv.enable_prefix_caching = True
    print("kvpilot, prefix caching off:", _fmt(results["kvpilot_no_prefix_caching"]))

    if not args.skip_transformers:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(engine.model_dir, dtype=torch.float32).eval()
        for sharing in (True, False):
            key = f"transformers_generate_batch_{'sharing' if sharing else 'no_sharing'}"
            try:
                results[key] = run_transformers(model, prompts, args.max_tokens, sharing)
                print(f"transformers generate_batch, sharing={sharing}:", _fmt(results[key]))
            except Exception as e:  # noqa: BLE001 - record why the baseline could not run
                results[key] = {"error": f"{type(e).__name__}: {e}"}
                print(f"transformers generate_batch, sharing={sharing}: failed: {e}")
        # The baselines take minutes and a shared machine's load drifts: kvpilot runs again after them,
        # and the ratios use both of its runs, which bracket the baselines.
        results["kvpilot_prefix_caching_again"] = run_kvpilot(engine, prompts, args.max_tokens)
        print(
            "kvpilot, prefix caching on, after the baselines:", _fmt(results["kvpilot_prefix_caching_again"])
        )

    if args.against:
        print(f"this checkout vs {args.against}, alternating:")
        results["against"] = against(args.against, prompts, args.max_tokens, args.against_rounds)
        a = results["against"]
        print(
            f"against {args.against}: {a['tokens_per_s_ratio']:.2f}x tok/s, decode step "
            f"{a['median']['base']['decode_step_ms']:.1f} -> {a['median']['this']['decode_step_ms']:.1f} ms"
        )

    results["ttft"] = ttft_cases(engine, tok, args.ttft_repeats)
    print("TTFT (median s):", {k: round(v, 4) for k, v in results["ttft"]["median_seconds"].items()})
    results["reset_latency"] = reset_latency(100_000)
    print("reset with 100k cached blocks:", results["reset_latency"])

    ours = results["kvpilot_prefix_caching"]["tokens_per_s"]
    ratios = {"prefix_caching_on_vs_off": ours / results["kvpilot_no_prefix_caching"]["tokens_per_s"]}
    if "kvpilot_prefix_caching_again" in results:
        ours = statistics.mean([ours, results["kvpilot_prefix_caching_again"]["tokens_per_s"]])
    for key in ("transformers_generate_batch_sharing", "transformers_generate_batch_no_sharing"):
        if "tokens_per_s" in results.get(key, {}):
            ratios[f"kvpilot_vs_{key}"] = ours / results[key]["tokens_per_s"]
    results["ratios"] = ratios
    results["env"] = {
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "cpu": platform.processor(),
        "device": str(engine.device),
        "dtype": str(engine.dtype),
    }
    print("ratios:", {k: round(v, 2) for k, v in ratios.items()})
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {args.output}")


def _fmt(r: dict) -> str:
    step = f", decode step {r['decode_step_ms']:.1f} ms" if r.get("decode_step_ms") else ""
    return f"{r['tokens_per_s']:.1f} tok/s ({r['output_tokens']} tokens in {r['seconds']:.1f} s{step})"


if __name__ == "__main__":
    main()
