"""Pinned prefixes in the engine (the real model): when a pin is taken, which blocks it holds, and what the
pool keeps for the requests (`docs/engine.md`, "Pinned prefixes and the eviction policy")."""

from __future__ import annotations

import pytest

from kvpilot.daemon.engine.admission import RequestRejected
from kvpilot.daemon.engine.request import SamplingParams

BS = 16


def run(eng, rid: str, prompt: list[int], max_tokens: int = 2, pin: bool = False) -> list:  # noqa: ANN001
    eng.add_request(rid, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True), pin_prefix=pin)
    outs = []
    while eng.has_unfinished_requests():
        outs += [o for o in eng.step() if o.request_id == rid]
    return outs


def test_a_request_ended_after_its_first_token_has_pinned_already(make_engine) -> None:  # noqa: ANN001
    """The server ends a request at a stop string by aborting it: its prompt was computed, so it is pinned,
    and the outputs it had say so."""
    eng = make_engine(num_kv_blocks=64, enable_pinned_prefix=True)
    eng.add_request(
        "s", list(range(100, 164)), SamplingParams(max_tokens=50, ignore_eos=True), pin_prefix=True
    )
    first = []
    while not first:
        first = [o for o in eng.step() if o.request_id == "s"]
    assert first[0].pin is not None and first[0].pin.pinned and first[0].pin.blocks == 4, first[0].pin
    assert eng.abort_request("s")
    assert eng.stats().pinned_blocks == 4


def test_a_prompt_of_whole_blocks_pins_the_blocks_the_index_holds(make_engine) -> None:  # noqa: ANN001
    """Sent before without a pin, a prompt of exactly 4 blocks hits 3 of them and computes its last token
    into a copy of the fourth, never indexed: the pin takes the indexed fourth, all 4 blocks."""
    eng = make_engine(num_kv_blocks=64, enable_pinned_prefix=True)
    prompt = list(range(200, 200 + 4 * BS))
    run(eng, "a", prompt)
    outs = run(eng, "b", prompt, pin=True)
    assert outs[0].num_cached_tokens == 3 * BS
    assert outs[-1].pin is not None and (outs[-1].pin.pinned, outs[-1].pin.blocks) == (True, 4)
    for i in range(30):  # a load of other prompts evicts everything but the pins
        run(eng, f"x{i}", list(range(1000 + 40 * i, 1000 + 40 * i + 3 * BS)), max_tokens=1)
    assert run(eng, "c", prompt)[0].num_cached_tokens == 3 * BS  # its full blocks short of the last token


def test_the_longest_prompt_leaves_the_pinnable_blocks_out(make_engine) -> None:  # noqa: ANN001
    """Pins may hold 4 of 20 blocks: a prompt needing more than the other 16 would wait for blocks no eviction
    frees, holding up every request behind it. It is refused at once, and one that fits runs."""
    eng = make_engine(num_kv_blocks=20, block_size=4, enable_pinned_prefix=True, max_model_len=None)
    assert eng.max_model_len == (20 - 4) * 4
    run(eng, "pin", list(range(300, 317)), pin=True)
    assert eng.stats().pinned_blocks == 4
    with pytest.raises(RequestRejected, match="context length"):
        eng.add_request("long", list(range(400, 470)), SamplingParams(max_tokens=1))
    assert run(eng, "fits", list(range(500, 560)), max_tokens=3)[-1].finish_reason == "length"
