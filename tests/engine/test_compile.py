"""The compiled step (`-O1`: torch.compile of the forward, daemon/engine/compile/) on the real default model,
against the eager one (`-O0`) side by side: the same greedy tokens, across prefix hits, a reset between
compiled steps, a weight update that changes the parameters in place, steps with LoRA rows (eager) among
compiled ones, and a prefix copied back from the host tier; and how the flags are read.
CUDA graphs (`-O2` on CUDA) have their twin in tests/gpu/test_compile_cuda.py."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvpilot.daemon.engine.compile.config import parse_compilation_config
from kvpilot.daemon.engine.config import EngineConfig
from kvpilot.daemon.engine.engine import LLMEngine
from kvpilot.daemon.engine.request import SamplingParams
from support.engine import assert_a_weight_update_reaches_both, run_alone

GREEDY = SamplingParams(max_tokens=12, ignore_eos=True)
BLOCK_BYTES = 737_280  # one block of the default model's fp32 KV


@pytest.fixture(scope="module")
def engines() -> Iterator[tuple[LLMEngine, LLMEngine]]:
    """(eager, compiled), each with its own small pool; the compiled one compiles on its first step
    (about a minute with an empty compile cache on this machine, seconds with the cache)."""
    eager = LLMEngine(EngineConfig(num_kv_blocks=256, compilation_config="0"))
    compiled = LLMEngine(EngineConfig(num_kv_blocks=256, compilation_config="1"))
    assert compiled.runner.forward.config.level == 1 and eager.runner.forward.config.level == 0
    yield eager, compiled


def test_the_compiled_step_gives_the_eager_steps_tokens_through_hits_and_resets(
    engines: tuple[LLMEngine, LLMEngine],
    chat_prompts: list[list[int]],
    shared_prefix_prompts: list[list[int]],
) -> None:
    eager, compiled = engines
    batch = [eager.generate(chat_prompts, GREEDY), compiled.generate(chat_prompts, GREEDY)]
    assert batch[0] == batch[1]
    # one request alone: steps of one token, the graph torch.compile specializes for size 1
    assert (
        run_alone(eager, "alone", chat_prompts[0], GREEDY)[0]
        == run_alone(compiled, "alone", chat_prompts[0], GREEDY)[0]
    )
    for e in engines:
        e.reset_prefix_cache()
    first = [run_alone(e, "p0", shared_prefix_prompts[0], GREEDY) for e in engines]
    # the others hit the shared system prompt: the attention op reads it from the pool
    again = [e.generate(shared_prefix_prompts[1:], GREEDY) for e in engines]
    hits = [e.stats().hit_tokens for e in engines]
    assert first[0] == first[1] and again[0] == again[1]
    assert hits[0] == hits[1] > 0
    for e in engines:  # a reset between compiled steps: the next prompt is computed again, the same
        e.reset_prefix_cache()
    after = [run_alone(e, "p0-again", shared_prefix_prompts[0], GREEDY) for e in engines]
    assert after[0] == after[1] == (first[0][0], 0)


def test_a_weight_update_in_place_reaches_the_compiled_step(
    engines: tuple[LLMEngine, LLMEngine], chat_prompts: list[list[int]]
) -> None:
    """An update copies into the parameters' own storage (weights/stage.py): the compiled step must read
    the new values, not what it saw when it compiled."""
    assert_a_weight_update_reaches_both(engines, chat_prompts[2], GREEDY)


@pytest.mark.parametrize(
    "text, eager, device, want",
    [
        (None, False, "cpu", (0, ())),  # the CPU's default: eager (docs/performance.md says why)
        (None, False, "cuda", (2, (1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64))),  # up to max_num_seqs
        ("1", False, "cuda", (1, ())),
        ("3", False, "cpu", (3, ())),  # no CUDA graphs on the CPU
        ("3", True, "cuda", (0, ())),  # --enforce-eager wins
        ('{"level": 2, "cudagraph_capture_sizes": [8, 1, 4, 4]}', False, "cuda", (2, (1, 4, 8))),
        ('{"level": 2, "max_cudagraph_capture_size": 8}', False, "cuda", (2, (1, 2, 4, 8))),
    ],
)
def test_levels_and_capture_sizes(text: str | None, eager: bool, device: str, want: tuple) -> None:
    c = parse_compilation_config(text, eager, device, max_num_seqs=64)
    assert (c.level, c.cudagraph_capture_sizes) == want


@pytest.mark.parametrize(
    "text, message",
    [
        ("4", "compilation level must be one of 0, 1, 2, 3"),
        ('{"level": true}', "compilation level must be one of"),
        ("[1]", "a level (0-3) or a JSON object"),
        ("{", "a level (0-3) or a JSON object"),
        (
            '{"cudagraph_capture_sizes": [0]}',
            "cudagraph_capture_sizes must be a list of integers in [1, 512]",
        ),
        ('{"max_cudagraph_capture_size": 4096}', "max_cudagraph_capture_size must be an integer in [0, 512]"),
        ('{"cache_dir": ""}', "cache_dir must be a directory path"),
    ],
)
def test_bad_configs_are_refused_with_what_is_wrong(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
        parse_compilation_config(text, False, "cuda", max_num_seqs=64)


def test_a_compiled_step_writes_only_its_own_slots(engines: tuple[LLMEngine, LLMEngine]) -> None:
    """The attention op writes the step's K/V where the step's slot mapping says, nowhere else: the pool's
    other blocks are untouched by compiled steps."""
    compiled = engines[1]
    compiled.reset_prefix_cache()
    k = compiled.runner.kv_caches[0][0]
    k.fill_(7.0)
    run_alone(compiled, "pad", [1, 2, 3], SamplingParams(max_tokens=2, ignore_eos=True))
    untouched = (k == 7.0).flatten(1).all(1)
    assert int((~untouched).sum()) == 1  # one block written: the request's own
    compiled.reset_prefix_cache()


@pytest.fixture(scope="module")
def adapted(make_engine, lora_adapters) -> Iterator[tuple[LLMEngine, LLMEngine]]:  # noqa: ANN001
    """(eager, compiled) with LoRA adapters and a host tier of 64 blocks behind a pool of 24 (the
    shared-prefix prompts and the long ones push each other out of it)."""
    opts = {
        "num_kv_blocks": 24,
        "kv_offloading_size": 64 * BLOCK_BYTES / 2**30,
        "enable_lora": True,
        "lora_modules": [f"{n}={p}" for n, p in lora_adapters.items()],
    }
    pair = make_engine(compilation_config="0", **opts), make_engine(compilation_config="1", **opts)
    yield pair
    for e in pair:
        e.close()


def test_steps_with_lora_rows_among_compiled_steps_give_the_eager_tokens(
    adapted: tuple[LLMEngine, LLMEngine], chat_prompts: list[list[int]]
) -> None:
    """A step with adapter rows runs eager on the compiled engine, the base-only steps around it compiled:
    the tokens are the eager engine's, row by row, before and after the compiled graph has run, and the
    adapters still change their rows' answers."""
    names = [None, "every-layer", "attention-only"]
    prompts = chat_prompts[:3]
    mixed = [e.generate(prompts, GREEDY, lora_names=names) for e in adapted]
    assert mixed[0] == mixed[1]
    base = [e.generate(prompts, GREEDY) for e in adapted]  # base rows only: the compiled graph
    assert base[0] == base[1]
    assert 0 in adapted[1].runner.forward.graphs_run and not adapted[0].runner.forward.graphs_run
    assert mixed[1][0] == base[1][0] and mixed[1][1:] != base[1][1:], "the adapters change their rows"
    for e in adapted:
        e.reset_prefix_cache()
    again = [e.generate(prompts, GREEDY, lora_names=names) for e in adapted]  # eager after compiled steps
    assert again[0] == again[1] == mixed[0]


def test_a_prefix_copied_back_from_the_host_tier_gives_the_eager_tokens(
    adapted: tuple[LLMEngine, LLMEngine], shared_prefix_prompts: list[list[int]]
) -> None:
    """Evicted to host memory and copied back into the pool, a prefix is read by the compiled step's
    attention op as by the eager one: the same tokens, every full block a hit."""
    prompt = shared_prefix_prompts[0]
    longs = [[1000 + (37 * i + 11 * j) % 39000 for j in range(300)] for i in range(3)]
    got = []
    for e in adapted:
        e.reset_prefix_cache()
        first = run_alone(e, "tier-first", prompt, GREEDY)
        for i, p in enumerate(longs):  # ~19 blocks each: the prompt's blocks leave the pool for the host tier
            run_alone(e, f"tier-flush-{i}", p, GREEDY)
        assert sum(t.blocks for t in e.stats().offload) > 0
        loaded_before = sum(t.loaded_blocks for t in e.stats().offload)  # (counted since the engine started)
        again = run_alone(e, "tier-again", prompt, GREEDY)
        loaded = sum(t.loaded_blocks for t in e.stats().offload) - loaded_before
        got.append((first, again, loaded))
    full = (len(prompt) - 1) // 16
    assert got[0] == got[1]
    first, again, loaded = got[1]
    assert first[1] == 0 and again == (first[0], full * 16) and loaded == full
