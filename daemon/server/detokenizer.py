"""Token ids -> text deltas for streaming, and stop strings that may span token boundaries."""

from __future__ import annotations

from typing import Any


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas, decoding only a short window each time.

    Decoding tokens one by one is wrong for byte-level BPE (a multi-byte character spans tokens) and
    for SentencePiece (spaces depend on the previous token), so each step decodes the window
    `[prefix_offset:]` and emits what it adds over `[prefix_offset:read_offset]`. A window ending in
    U+FFFD is an unfinished character: hold it back until the next token completes it.
    """

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._ids: list[int] = []
        self._prefix_offset = 0
        self._read_offset = 0

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
        return self._tokenizer.decode(ids, skip_special_tokens=True)


class StopStrings:
    """Holds back text that could be the start of a stop string; cuts the text at the first match.

    The text after a stop string is never emitted, and the stop string itself is not part of the
    output (OpenAI's behaviour).
    """

    def __init__(self, stops: list[str]) -> None:
        self._stops = stops
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
            hits = [i for i in (self._text.find(s, self._sent) for s in self._stops) if i >= 0]
            if hits:
                end = min(hits)
                return self._emit(end), True
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
