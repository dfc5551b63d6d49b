"""LoRA throughput: one load through the engine on the base model alone, all on one adapter, and spread
over four adapters mixed in every batch.

The adapters are written here in peft's layout (rank 16 on every projection of every layer, random
weights), so the bench needs no peft. The three modes run alternately, `--repeats` times each, in one
engine; the JSON under bench/results/ has each mode's output tokens per second and its ratio to the base
model's in the same run.

    python bench/lora.py                 # 16 requests x 64 new tokens, 3 repeats
    python bench/lora.py --quick         # a smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

sys.path.append(str(Path(__file__).resolve().parents[1] / "hack" / "lib"))  # benchkit
import benchkit  # noqa: E402
from kvpilot.daemon.engine.config import EngineConfig  # noqa: E402
from kvpilot.daemon.engine.engine import LLMEngine  # noqa: E402
from kvpilot.daemon.engine.request import SamplingParams  # noqa: E402

RESULTS = Path(__file__).parent / "results"
TARGETS = {  # projection -> which way its (in, out) sizes come from the model's config
    "q_proj": ("hidden", "q"),
    "k_proj": ("hidden", "kv"),
    "v_proj": ("hidden", "kv"),
    "o_proj": ("q", "hidden"),
    "gate_proj": ("hidden", "mlp"),
    "up_proj": ("hidden", "mlp"),
    "down_proj": ("mlp", "hidden"),
}


def write_adapter(out: Path, engine: LLMEngine, rank: int, seed: int) -> Path:
    """A peft LoRA directory for the engine's model: every projection of every layer, random weights."""
    a = engine.runner.model.args
    sizes = {
        "hidden": a.hidden_size,
        "q": a.num_heads * a.head_dim,
        "kv": a.num_kv_heads * a.head_dim,
        "mlp": a.intermediate_size,
    }
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(a.num_layers):
        for name, (fan_in, fan_out) in TARGETS.items():
            part = "self_attn" if name in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            stem = f"base_model.model.model.layers.{layer}.{part}.{name}"
            tensors[f"{stem}.lora_A.weight"] = torch.randn(rank, sizes[fan_in], generator=gen) * 0.02
            tensors[f"{stem}.lora_B.weight"] = torch.randn(sizes[fan_out], rank, generator=gen) * 0.02
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(TARGETS)}
    (out / "adapter_config.json").write_text(json.dumps(config))
    return out


def run(engine: LLMEngine, prompts: list[list[int]], names: list[str | None], max_tokens: int) -> float:
    """Output tokens per second of the whole load, run to completion in one engine."""
    engine.reset_prefix_cache()  # every mode computes its prompts
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    outs = engine.generate(prompts, params, lora_names=names)
    return sum(len(o) for o in outs) / (time.perf_counter() - start)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rank", type=int, default=16, help="LoRA rank of the adapters")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="4 requests x 8 tokens, 1 repeat")
    ap.add_argument("--output", type=Path, default=None)
    args = ap.parse_args()
    if args.quick:
        args.requests, args.max_tokens, args.repeats = 4, 8, 1
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        probe = LLMEngine(EngineConfig(num_kv_blocks=16))
        names = [f"adapter-{i}" for i in range(4)]
        paths = [write_adapter(Path(tmp) / n, probe, args.rank, seed=i) for i, n in enumerate(names)]
        del probe
        engine = LLMEngine(
            EngineConfig(
                num_kv_blocks=args.requests * (args.prompt_tokens + args.max_tokens) // 16 + 32,
                enable_lora=True,
                lora_modules=[f"{n}={p}" for n, p in zip(names, paths)],
                max_lora_rank=args.rank,
                max_loras=4,
            )
        )
        gen = torch.Generator().manual_seed(0)
        vocab = engine.runner.model.args.vocab_size
        prompts = [
            torch.randint(100, vocab, (args.prompt_tokens,), generator=gen).tolist()
            for _ in range(args.requests)
        ]
        modes = {
            "base": [None] * args.requests,
            "one_adapter": [names[0]] * args.requests,
            "four_adapters_mixed": [names[i % 4] for i in range(args.requests)],
        }
        run(engine, prompts[:2], [None, names[0]], 4)  # warm-up
        samples: dict[str, list[float]] = {m: [] for m in modes}
        for _ in range(args.repeats):
            for mode, lora_names in modes.items():
                samples[mode].append(run(engine, prompts, lora_names, args.max_tokens))
                print(f"{mode:>20}: {samples[mode][-1]:.1f} tok/s", flush=True)
    tok_s = {m: statistics.median(v) for m, v in samples.items()}
    result = {
        **benchkit.header("lora", load_before),
        "config": {
            k: getattr(args, k) for k in ("requests", "prompt_tokens", "max_tokens", "rank", "repeats")
        },
        "env": {"torch": torch.__version__, "threads": torch.get_num_threads(), "device": str(engine.device)},
        "tok_s": tok_s,
        "vs_base": {m: tok_s[m] / tok_s["base"] for m in modes},
        "samples_tok_s": samples,
    }
    for m in modes:
        print(f"{m:>20}: {tok_s[m]:8.1f} tok/s  {result['vs_base'][m]:.3f}x base")
    benchkit.write(args.output or benchkit.default_path(RESULTS, "lora"), result)


if __name__ == "__main__":
    main()
