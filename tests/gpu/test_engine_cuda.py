"""The engine on CUDA: the triton path gives the torch reference path's greedy tokens (fp32, where both
paths run IEEE matmuls, so greedy choices do not flip on rounding). Eager (--enforce-eager): a compiled
step runs inductor's kernels for all but the attention, and these tests are of the triton ones; the
compiled step has its own, tests/gpu/test_compile_cuda.py."""

from __future__ import annotations

import pytest

from kvpilot.daemon.engine.config import EngineConfig
from kvpilot.daemon.engine.engine import LLMEngine
from kvpilot.daemon.engine.request import SamplingParams

pytestmark = pytest.mark.gpu

PROMPTS = [list(range(100, 123)), [5, 6, 7], list(range(1000, 1032)), list(range(2000, 2300))]


def _generate(model_dir, backend, **kw):
    eng = LLMEngine(
        EngineConfig(
            model=str(model_dir),
            device="cuda",
            dtype="float32",
            num_kv_blocks=256,
            block_size=16,
            kernel_backend=backend,
            enforce_eager=True,
            **kw,
        )
    )
    assert eng.ops.name == backend
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    return eng.generate(PROMPTS, params) + eng.generate(PROMPTS[:1], params)


@pytest.mark.parametrize("budget", [2048, 16])
def test_triton_matches_reference(sharp_tiny_model_dir, budget):
    ref = _generate(sharp_tiny_model_dir, "torch", max_num_batched_tokens=budget)
    assert _generate(sharp_tiny_model_dir, "triton", max_num_batched_tokens=budget) == ref
