"""The eager CPU step's packed linear weights (kernels/packed_linear.py) on the real default model: the
same greedy tokens as `F.linear` throughout, at every step size, through each kernel this machine has (the
project's panels, oneDNN), and a weight update reaches them. The panel kernel alone is tested in
tests/kernels/test_panel_gemm.py; oneDNN's op pair, on the installed torch, in tests/test_framework_guards.py."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from kvpilot.daemon.engine.config import EngineConfig
from kvpilot.daemon.engine.engine import LLMEngine
from kvpilot.daemon.engine.models.llama import PackedLinear
from kvpilot.daemon.engine.request import SamplingParams
from kvpilot.kernels import onednn_linear, packed_linear, panel_gemm
from kvpilot.kernels.packed_linear import CALIBRATED_ROWS, ONEDNN, PANELS, Kernel, PackedWeight
from support.engine import assert_a_weight_update_reaches_both, run_alone

GREEDY = SamplingParams(max_tokens=12, ignore_eos=True)

pytestmark = pytest.mark.skipif(
    packed_linear.kernel_for(torch.zeros(8, 8)) is None, reason="no kernel here packs a float32 weight"
)
# Each kernel this machine has: the preferred one is what the engine packs with, the other is put in by hand.
KERNELS = [
    pytest.param(PANELS, marks=pytest.mark.skipif(not panel_gemm.available(), reason="no panel kernel here")),
    pytest.param(
        ONEDNN, marks=pytest.mark.skipif(not onednn_linear.packable(torch.zeros(8, 8)), reason="no oneDNN")
    ),
]


def _packed_at_every_size(engine: LLMEngine, kernel: Kernel) -> None:
    """Every linear and the LM head take a packed copy of `kernel`'s at every row count up to the last
    calibrated one, whatever the start-up timing chose on this machine: the tests then go through it."""
    model = engine.runner.model
    every = tuple(n > 0 for n in range(CALIBRATED_ROWS[-1] + 1))
    linears = [m for m in model.modules() if isinstance(m, PackedLinear)]
    assert len(linears) == 4 * model.args.num_layers
    for m in linears:
        m.packed = PackedWeight.of(m.weight, kernel, every)
    model.head_packed = PackedWeight.of(model.head_weight(), kernel, every)


@pytest.fixture(scope="module")
def engines() -> Iterator[tuple[LLMEngine, LLMEngine]]:
    """(F.linear throughout, packed at every size)."""
    dense = LLMEngine(EngineConfig(num_kv_blocks=256))  # the default
    packed = LLMEngine(EngineConfig(num_kv_blocks=256, packed_linears=True))
    assert all(m.packed is None for m in dense.runner.model.modules() if isinstance(m, PackedLinear))
    chosen = packed_linear.kernel_for(torch.zeros(8, 8))
    assert chosen is not None
    # what the engine packed (if its timing kept any size: a busy machine may keep none) is the chosen kernel's
    copies = [m.packed for m in packed.runner.model.modules() if isinstance(m, PackedLinear) and m.packed]
    assert all(c.kernel is chosen for c in copies)
    _packed_at_every_size(packed, chosen)
    yield dense, packed


@pytest.mark.parametrize("kernel", KERNELS)
def test_packed_linears_give_the_same_tokens_at_every_step_size(
    engines: tuple[LLMEngine, LLMEngine], chat_prompts: list[list[int]], kernel: Kernel
) -> None:
    dense, packed = engines
    _packed_at_every_size(packed, kernel)
    assert dense.generate(chat_prompts, GREEDY) == packed.generate(chat_prompts, GREEDY)  # 8 rows a step
    assert run_alone(dense, "one", chat_prompts[0], GREEDY) == run_alone(
        packed, "one", chat_prompts[0], GREEDY
    )


@pytest.mark.parametrize("kernel", KERNELS)
def test_a_weight_update_in_place_reaches_the_packed_copies(
    engines: tuple[LLMEngine, LLMEngine], chat_prompts: list[list[int]], kernel: Kernel
) -> None:
    """An update copies into the parameters (weights/stage.py): the packed copies are made again from them,
    else the step would go on multiplying by the old weights."""
    _packed_at_every_size(engines[1], kernel)
    assert_a_weight_update_reaches_both(engines, chat_prompts[3], GREEDY)


def test_step_sizes_take_the_decision_of_the_calibrated_size_below_them() -> None:
    kernel = packed_linear.kernel_for(torch.zeros(8, 8))
    assert kernel is not None
    rows = packed_linear.fast_rows([torch.randn(256, 64)], kernel)
    assert len(rows) == CALIBRATED_ROWS[-1] + 1 and rows[0] is False
    for n in range(1, len(rows)):
        assert rows[n] == rows[max(c for c in CALIBRATED_ROWS if c <= n)]
    w = PackedWeight(torch.zeros(1), 1, kernel, (False, True, True, False))
    # more rows than the last calibrated count never take the packed copy (a long prefill chunk)
    assert [w.takes(torch.zeros(n, 1)) for n in range(6)] == [False, True, True, False, False, False]
    assert packed_linear.describe((False, True, True, False, True)) == "1-2, 4 rows"
    assert packed_linear.describe((False, False)) == "none"
