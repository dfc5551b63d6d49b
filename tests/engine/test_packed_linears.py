"""The eager CPU step's linear weights laid out for a faster kernel (kernels/packed_linear.py), on the real
default model: the project's panels in place of the weights (the default where they run), oneDNN's copies
beside them (`--packed-linears` where the panels do not run). The same greedy tokens as `F.linear`
throughout, at every step size, the same weights as the model's own (their digest), and a weight update
reaches them. The panel kernel alone is tested in tests/kernels/test_panel_gemm.py; oneDNN's op pair, on the
installed torch, in tests/test_framework_guards.py."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from kvpilot.daemon.engine.config import EngineConfig
from kvpilot.daemon.engine.engine import LLMEngine
from kvpilot.daemon.engine.models.llama import LlamaForCausalLM, PackedLinear
from kvpilot.daemon.engine.request import SamplingParams
from kvpilot.daemon.engine.weights.stage import weights_digest
from kvpilot.kernels import onednn_linear, packed_linear, panel_gemm
from kvpilot.kernels.packed_linear import CALIBRATED_ROWS, ONEDNN, PANELS, PackedWeight
from support.engine import assert_a_weight_update_reaches_both, run_alone

GREEDY = SamplingParams(max_tokens=12, ignore_eos=True)

# The engines run on one torch thread, where the panels are the choice wherever they run at all.
panels_here = pytest.mark.skipif(not panel_gemm.available(), reason="the panels do not run here")
onednn_here = pytest.mark.skipif(not onednn_linear.packable(torch.zeros(8, 8)), reason="no oneDNN here")


def _linears(model: LlamaForCausalLM) -> list[PackedLinear]:
    linears = [m for m in model.modules() if isinstance(m, PackedLinear)]
    assert len(linears) == 4 * model.args.num_layers
    return linears


@pytest.fixture(scope="module")
def engines() -> Iterator[tuple[LLMEngine, LLMEngine]]:
    """(F.linear throughout, the default: the panels in place of the weights where they run)."""
    dense = LLMEngine(EngineConfig(num_kv_blocks=256, cpu_threads=1, packed_linears=False))
    default = LLMEngine(EngineConfig(num_kv_blocks=256, cpu_threads=1))
    assert all(m.packed is None for m in _linears(dense.runner.model))
    yield dense, default


@panels_here
def test_the_panels_replace_the_weights_and_give_the_same_tokens(
    engines: tuple[LLMEngine, LLMEngine], chat_prompts: list[list[int]]
) -> None:
    dense, packed = engines
    model = packed.runner.model
    for m in _linears(model):
        assert m.packed is not None and m.packed.owns and m.packed.kernel is PANELS
        assert "weight" not in dict(m.named_parameters())  # no second copy kept
    assert model.head_packed is not None and model.head_packed.owns
    assert not any(name.endswith("proj.weight") for name, _ in model.named_parameters())
    # the same weights, read back from the panels: the layout is a permutation of the values
    digests = [weights_digest({n: w.read for n, w in e.runner.model.weights().items()}) for e in engines]
    assert digests[0] == digests[1]
    # 8 rows a step, one row, and the prefill of all eight prompts at once (hundreds of rows)
    assert dense.generate(chat_prompts, GREEDY) == packed.generate(chat_prompts, GREEDY)
    one = run_alone(dense, "one", chat_prompts[0], GREEDY)
    assert one == run_alone(packed, "one", chat_prompts[0], GREEDY)


@panels_here
def test_a_weight_update_reaches_the_panels(
    engines: tuple[LLMEngine, LLMEngine], chat_prompts: list[list[int]]
) -> None:
    """An update writes into the weights (weights/stage.py): where panels replaced them, into the panels."""
    assert_a_weight_update_reaches_both(engines, chat_prompts[3], GREEDY)


@onednn_here
def test_onednn_copies_give_the_same_tokens_and_follow_a_weight_update(
    engines: tuple[LLMEngine, LLMEngine], chat_prompts: list[list[int]]
) -> None:
    """oneDNN's copies beside the weights (`--packed-linears` where the panels do not run), put into the
    F.linear engine by hand at every step size, whatever a start-up timing here would choose."""
    dense, other = engines
    model = dense.runner.model
    want = other.generate(chat_prompts, GREEDY), run_alone(other, "one", chat_prompts[0], GREEDY)
    every = tuple(n > 0 for n in range(CALIBRATED_ROWS[-1] + 1))
    for m in _linears(model):
        m.packed = PackedWeight.of(m.weight, ONEDNN, every)
    model.head_packed = PackedWeight.of(model.head_weight(), ONEDNN, every)
    try:
        assert (
            dense.generate(chat_prompts, GREEDY),
            run_alone(dense, "one", chat_prompts[0], GREEDY),
        ) == want
        assert_a_weight_update_reaches_both((other, dense), chat_prompts[3], GREEDY)
    finally:
        for m in _linears(model):
            m.packed = None
        model.head_packed = None


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
