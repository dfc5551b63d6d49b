"""Token ids -> text deltas for streaming, and stop strings that may span token boundaries."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

# Prompt tokens kept as left context of the first output token (vLLM keeps 5 as well).
PROMPT_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas, decoding only a short window each time.

    Decoding tokens one by one is wrong for byte-level BPE (a multi-byte character spans tokens) and
    for SentencePiece (spaces depend on the previous token), so each step decodes the window
    `[prefix_offset:]` and emits what it adds over `[prefix_offset:read_offset]`. A window ending in
    U+FFFD is an unfinished character: hold it back until the next token completes it.

    The window starts with the prompt's last tokens: SentencePiece decodes a word-initial token without
    its leading space when it comes first, so the first output token needs its left neighbour.
    """

    def __init__(
        self, tokenizer: Any, prompt_ids: Sequence[int] = (), skip_special_tokens: bool = True
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self._ids: list[int] = list(prompt_ids[-PROMPT_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)

    def push(self, token_ids: list[int], final: bool = False) -> str:
        self._ids.extend(token_ids)
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        full_text = self._decode(self._ids[self._prefix_offset :])
        if len(full_text) > len(prefix_text) and (final or not full_text.endswith("\ufffd")):
            self._prefix_offset = self._read_offset
            self._read_offset = len(self._ids)
            return full_text[len(prefix_text) :]
        return ""

    def _decode(self, ids: list[int]) -> str:
        if not ids:
            return ""
        # a transformers tokenizer (Any): decode gives the text
        text: str = self._tokenizer.decode(ids, skip_special_tokens=self._skip_special)
        return text


class StopStrings:
    """Holds back text that could be the start of a stop string; cuts the text at the first match.

    The text after a stop string is never emitted; the stop string itself is not part of the output
    (OpenAI's behaviour) unless `include_stop` (vLLM's include_stop_str_in_output).
    """

    def __init__(self, stops: list[str], include_stop: bool = False) -> None:
        self._stops = stops
        self._include = include_stop
        self._text = ""
        self._sent = 0

    @property
    def text(self) -> str:
        return self._text[: self._sent]

    def feed(self, delta: str, final: bool = False) -> tuple[str, bool]:
        """Returns (text safe to emit now, whether a stop string was hit)."""
        self._text += delta
        if self._stops:
            # A match must start at or after `_sent`: anything earlier was complete and checked before.
            hits = [(i, len(s)) for s in self._stops if (i := self._text.find(s, self._sent)) >= 0]
            if hits:
                start, length = min(hits)
                return self._emit(start + length if self._include else start), True
        end = len(self._text) if final else len(self._text) - self._partial_match()
        return self._emit(end), False

    def _partial_match(self) -> int:
        """Length of the longest tail of the unsent text that begins some stop string."""
        tail = self._text[self._sent :]
        for k in range(min(len(tail), max((len(s) for s in self._stops), default=1) - 1), 0, -1):
            if any(s.startswith(tail[-k:]) for s in self._stops):
                return k
        return 0

    def _emit(self, end: int) -> str:
        out = self._text[self._sent : end]
        self._sent = max(self._sent, end)
        return out
