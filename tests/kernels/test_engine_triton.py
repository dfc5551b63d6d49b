"""The engine end to end on the triton path (interpreter) gives the reference path's greedy tokens.

Uses the shared `tiny_model_dir` (tests/conftest.py: a 2-layer random-weight Llama with GQA, 4 query heads,
2 KV heads, head size 16, and the default model's tokenizer) with its layer weights scaled up
(`sharp_tiny_model_dir`), so that the greedy tokens depend on what attention computes.
"""

from __future__ import annotations

import pytest

from kvpilot.daemon.engine.config import EngineConfig
from kvpilot.daemon.engine.engine import LLMEngine
from kvpilot.daemon.engine.request import SamplingParams

PROMPTS = [
    list(range(100, 123)),  # 23 tokens: one full block and a partial one
    [5, 6, 7],
    list(range(1000, 1032)),  # exactly two blocks
]


def _engine(model_dir, backend: str, **kw) -> LLMEngine:
    cfg = dict(model=str(model_dir), num_kv_blocks=64, block_size=16, kernel_backend=backend, dtype="float32")
    cfg.update(kw)
    return LLMEngine(EngineConfig(**cfg))


@pytest.fixture(scope="module")
def reference_tokens(sharp_tiny_model_dir):
    eng = _engine(sharp_tiny_model_dir, "torch")
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    return eng.generate(PROMPTS, params), eng.generate(PROMPTS[:1], params)


def test_greedy_tokens_match_reference(sharp_tiny_model_dir, reference_tokens):
    """Mixed prefill and decode steps, then the same prompt again: its full block comes from the prefix
    cache, so the second prefill is a chunk over cached blocks."""
    eng = _engine(sharp_tiny_model_dir, "triton")
    assert eng.ops.name == "triton"
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    batch, again = reference_tokens
    assert len({t for out in batch for t in out}) > 4, "degenerate model: tokens do not depend on attention"
    assert eng.generate(PROMPTS, params) == batch
    assert eng.generate(PROMPTS[:1], params) == again
    assert eng.stats().hit_tokens >= 16


def test_chunked_prefill_matches_reference(sharp_tiny_model_dir, reference_tokens):
    """A small token budget cuts prompts into chunks that share steps with other requests' decodes."""
    eng = _engine(sharp_tiny_model_dir, "triton", max_num_batched_tokens=8, enable_prefix_caching=False)
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    assert eng.generate(PROMPTS, params) == reference_tokens[0]


def test_lora_adapters_mixed_in_a_batch_match_reference(sharp_tiny_model_dir, tmp_path):
    """Two adapters and the base model in one batch, on the triton path (its lora_add kernel): the torch
    path's greedy tokens (tests/engine/test_lora.py holds that path to peft's)."""
    from support.lora import make_adapter

    adapters = {
        "a": make_adapter(sharp_tiny_model_dir, tmp_path / "a", seed=1, scale=0.5),
        "b": make_adapter(
            sharp_tiny_model_dir, tmp_path / "b", seed=2, r=4, targets=["q_proj", "v_proj"], scale=0.5
        ),
    }
    lora = dict(enable_lora=True, lora_modules=[f"{n}={p}" for n, p in adapters.items()])
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    names = ["a", None, "b"]
    reference = _engine(sharp_tiny_model_dir, "torch", **lora)
    expected = reference.generate(PROMPTS, params, lora_names=names)
    base = reference.generate(PROMPTS, params)
    assert expected[0] != base[0] and expected[2] != base[2], "the adapters change nothing: nothing is proven"
    eng = _engine(sharp_tiny_model_dir, "triton", **lora)
    assert eng.generate(PROMPTS, params, lora_names=names) == expected
