"""Streaming text: incremental detokenization and stop strings across token boundaries."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import AutoTokenizer

from kvpilot.daemon.server.detokenizer import IncrementalDetokenizer, StopStrings


@pytest.fixture(scope="module")
def tokenizer(default_model_dir: Path):  # noqa: ANN201
    return AutoTokenizer.from_pretrained(default_model_dir)


@pytest.mark.parametrize(
    "text", ["Hello, world! Ça va? 日本語のテキスト 🚲🚀 end", "  two  spaces\n\nnew\tlines"]
)
def test_deltas_add_up_to_the_full_decode(tokenizer, text: str) -> None:  # noqa: ANN001
    ids = tokenizer.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer)
    deltas = [detok.push([t], final=i == len(ids) - 1) for i, t in enumerate(ids)]
    assert "".join(deltas) == tokenizer.decode(ids)
    assert all("\ufffd" not in d for d in deltas)  # half characters are held back, never emitted


def test_stop_string_split_across_deltas() -> None:
    s = StopStrings(["STOP here"])
    out = [s.feed("abc ST"), s.feed("OP he"), s.feed("re and more")]
    assert out == [("abc ", False), ("", False), ("", True)]
    assert s.text == "abc "


def test_partial_match_released_when_it_is_not_a_stop() -> None:
    s = StopStrings(["</end>"])
    assert s.feed("x </e") == ("x ", False)
    assert s.feed("lse") == ("</else", False)
    assert s.feed("!", final=True) == ("!", False)


def test_earliest_of_several_stops_wins() -> None:
    s = StopStrings(["bb", "a"])
    assert s.feed("xxbbya") == ("xx", True)
