"""The engine's default CPU op set on the real default model: decode steps attend through the C kernel
(kernels/cpu_attention.py), the norms, rotary and activation run in C (kernels/cpu_elementwise.py), and
the greedy tokens are those of the torch reference, for a batch sharing a system prompt (its blocks shared
in the pool) and for one request alone. The kernels alone are tested in tests/kernels/test_cpu_attention.py
and tests/kernels/test_cpu_elementwise.py."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from kvpilot.daemon.engine.config import EngineConfig
from kvpilot.daemon.engine.engine import LLMEngine
from kvpilot.daemon.engine.request import SamplingParams
from kvpilot.kernels import cpu_attention
from kvpilot.kernels.ops import CPU_OPS, TORCH_OPS
from support.engine import run_alone

GREEDY = SamplingParams(max_tokens=24, ignore_eos=True)

pytestmark = pytest.mark.skipif(not cpu_attention.available(), reason="no AVX2/FMA or no C compiler here")


@pytest.fixture(scope="module")
def engine() -> Iterator[LLMEngine]:
    engine = LLMEngine(EngineConfig(num_kv_blocks=256, cpu_threads=1))  # the default op set, on one thread
    assert engine.runner.model.ops is CPU_OPS
    yield engine
    engine.runner.model.ops = CPU_OPS


def test_the_cpu_ops_give_the_references_tokens(
    engine: LLMEngine, shared_prefix_prompts: list[list[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    kernel_calls = []
    attend = cpu_attention._library().paged_attention  # type: ignore[union-attr]

    def counted(*args: object) -> int:
        kernel_calls.append(args)
        return attend(*args)  # type: ignore[no-any-return]

    monkeypatch.setattr(cpu_attention._library(), "paged_attention", counted)
    through_kernel = engine.generate(shared_prefix_prompts, GREEDY)
    alone = run_alone(engine, "one", shared_prefix_prompts[0], GREEDY)
    # every decode step of every layer went through the C code
    assert len(kernel_calls) >= engine.runner.model.args.num_layers * (GREEDY.max_tokens - 1)
    engine.runner.model.ops = TORCH_OPS  # the same engine, attention through the reference
    assert engine.generate(shared_prefix_prompts, GREEDY) == through_kernel
    assert run_alone(engine, "one", shared_prefix_prompts[0], GREEDY) == alone
    assert torch.get_num_threads() == 1
