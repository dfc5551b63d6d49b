"""The compiled step on CUDA (`-O2`: torch.compile with CUDA graphs replayed between the attention ops;
`-O1`: compiled, no graphs) gives the eager step's greedy tokens (fp32 on the sharp tiny model, so greedy
choices do not flip on rounding): one-token steps (captured size 1), batches padded to a captured size,
a step past the largest size (compiled, not graphed), a reset between replays, and a weight update in
place that the graphs must see. The CPU twin is tests/engine/test_compile.py."""

from __future__ import annotations

import pytest

from kvpilot.daemon.engine.config import EngineConfig
from kvpilot.daemon.engine.engine import LLMEngine
from kvpilot.daemon.engine.request import SamplingParams

pytestmark = pytest.mark.gpu

PROMPTS = [list(range(100, 123)), [5, 6, 7], list(range(1000, 1032)), list(range(2000, 2300)), [9] * 40]
PARAMS = SamplingParams(max_tokens=16, ignore_eos=True)


def _engine(model_dir, level: str) -> LLMEngine:  # noqa: ANN001
    config = '{"level": 2, "cudagraph_capture_sizes": [1, 2, 4, 8]}' if level == "2" else level
    return LLMEngine(
        EngineConfig(
            model=str(model_dir), device="cuda", dtype="float32", num_kv_blocks=256, compilation_config=config
        )
    )


def _run(eng: LLMEngine) -> list[list[int]]:
    out = eng.generate(PROMPTS, PARAMS) + eng.generate(PROMPTS[:1], PARAMS)
    eng.reset_prefix_cache()
    return out + eng.generate(PROMPTS[2:3], PARAMS)


@pytest.mark.parametrize("level", ["1", "2"])
def test_compiled_and_graphed_steps_match_eager(sharp_tiny_model_dir, level: str) -> None:  # noqa: ANN001
    assert _run(_engine(sharp_tiny_model_dir, level)) == _run(_engine(sharp_tiny_model_dir, "0"))


def test_a_weight_update_in_place_reaches_the_graphs(sharp_tiny_model_dir) -> None:  # noqa: ANN001
    engines = [_engine(sharp_tiny_model_dir, "2"), _engine(sharp_tiny_model_dir, "0")]
    before = [_run(e) for e in engines]
    for e in engines:
        layers = e.runner.model.layers
        e.swap_weights("v2", lambda layers=layers: [x.mlp.down_proj.weight.data.mul_(-1.0) for x in layers])
    after = [_run(e) for e in engines]
    assert before[0] == before[1] and after[0] == after[1] != before[0]
