"""One model step, this checkout's model and ops against another checkout's, interleaved in one process.

The shared-prefix load of bench/engine.py (16 chat requests sharing a ~295-token system prompt) runs
until every request has decoded `--decode-after` tokens; its first step (the prefill) and that decode
step are captured and then re-run many times through both implementations, alternating call by call,
so that both see the same machine load (on a shared machine, end-to-end runs minutes apart do not).
Each call builds the step's inputs afresh (`ModelRunner._prepare`), so per-step work such as the
attention plan is counted. Reports the median ms per step and the speedup; the logits of both are
compared too. JSON to bench/results/decode-step.json.

    python bench/decode_step.py --against ../main      # another checkout of kvpilot (its sources)
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

from kvpilot.daemon.engine.config import EngineConfig
from kvpilot.daemon.engine.engine import LLMEngine
from kvpilot.daemon.engine.request import SamplingParams
from kvpilot.kernels import Ops

RESULTS = Path(__file__).parent / "results"


def _load(path: Path, name: str):  # noqa: ANN202
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def base_model(checkout: Path, model: torch.nn.Module) -> torch.nn.Module:
    """The other checkout's Llama on the other checkout's torch reference ops, with this model's weights."""
    reference = _load(checkout / "kernels" / "reference.py", "base_reference")
    llama = _load(checkout / "daemon" / "engine" / "models" / "llama.py", "base_llama")
    ops = Ops(
        "base-torch",
        reference.write_kv,
        reference.paged_attention,
        reference.rms_norm,
        reference.rotary,
        reference.silu_and_mul,
    )
    args = llama.LlamaArgs(**dataclasses.asdict(model.args))
    base = llama.LlamaForCausalLM(args, ops)
    base.load_state_dict({name: w.read() for name, w in model.weights().items()})  # panels read back
    return base.requires_grad_(False).eval()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--against", type=Path, required=True, help="the other checkout (its sources are loaded)")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--decode-after", type=int, default=32, help="decode steps run before the one measured")
    ap.add_argument("--repeats", type=int, default=20, help="calls of each implementation per step kind")
    ap.add_argument("--output", type=Path, default=RESULTS / "decode-step.json")
    args = ap.parse_args()

    bench = _load(Path(__file__).resolve().parent / "engine.py", "bench_engine")
    engine = LLMEngine(EngineConfig(num_kv_blocks=512))
    prompts = [
        bench.chat(engine.tokenizer, bench.QUESTIONS[i % len(bench.QUESTIONS)]) for i in range(args.requests)
    ]
    params = SamplingParams(max_tokens=args.decode_after + 8, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, dataclasses.replace(params))
    runner = engine.runner
    captured = []
    schedule = engine.scheduler.schedule

    def capture():  # noqa: ANN202
        out = schedule()
        captured.append(out)
        return out

    engine.scheduler.schedule = capture
    for _ in range(1 + args.decode_after):
        engine.step()
    engine.scheduler.schedule = schedule
    steps = {"prefill": captured[0], "decode": captured[-1]}
    assert all(c.num_tokens == 1 for c in steps["decode"].chunks), "the measured step must be decode-only"
    # Nothing runs after this: every captured request still holds its blocks, so both re-runs read the
    # same context (a re-run rewrites its own new tokens' K/V in place).
    models = {"base": base_model(args.against, runner.model), "this": runner.model}

    def forward(name: str, out) -> torch.Tensor:  # noqa: ANN001
        return models[name](runner._prepare(out), runner.kv_caches)

    results: dict = {}
    for kind, out in steps.items():
        logits = {name: forward(name, out) for name in models}
        times: dict[str, list[float]] = {name: [] for name in models}
        for _ in range(args.repeats):
            for name in models:
                t0 = time.perf_counter()
                forward(name, out)
                times[name].append(time.perf_counter() - t0)
        med = {name: statistics.median(t) * 1e3 for name, t in times.items()}
        results[kind] = {
            "tokens": sum(c.num_tokens for c in out.chunks),
            "sequences": len(out.chunks),
            "context_tokens": sum(c.start + c.num_tokens for c in out.chunks),
            "median_ms": med,
            "speedup": med["base"] / med["this"],
            "logits_max_abs_diff": float((logits["base"] - logits["this"]).abs().max()),
            "same_greedy_tokens": bool(torch.equal(logits["base"].argmax(-1), logits["this"].argmax(-1))),
        }
        r = results[kind]
        print(
            f"{kind}: {r['tokens']} tokens of {r['sequences']} sequences: {med['base']:.1f} -> {med['this']:.1f} ms "
            f"({r['speedup']:.2f}x), logits max |diff| {r['logits_max_abs_diff']:.2e}, "
            f"same greedy tokens: {r['same_greedy_tokens']}"
        )
    results["against"] = {"checkout": str(args.against.resolve()), "commit": bench._git_head(args.against)}
    results["this_commit"] = bench._git_head(Path(__file__).resolve().parent.parent)
    results["env"] = {
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "cpu": platform.processor(),
        "repeats": args.repeats,
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
