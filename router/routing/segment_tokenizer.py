"""A tokenizer's `encode`, exactly, with each piece of text between two added tokens remembered.

Most of what the router pays for a chat is tokenizing it: 0.3-0.4 ms of a 200-token chat on these cores,
nearly all of it the byte-level pre-tokenizer's regex, for a system prompt it has tokenized many times
before. A fast (Rust) tokenizer cuts a text at its added tokens (`<|im_start|>`, `<|im_end|>`, ...) before
anything else and tokenizes each piece between them on its own, so a rendered chat's ids are its pieces'
ids joined, and a system prompt's piece can be looked up instead of tokenized again.

That holds for a tokenizer whose added tokens match as plain strings (no lstrip, rstrip, single_word, or
normalized matching) and whose pre-tokenizer treats every piece alike (ByteLevel does; Metaspace's
"first" prefix does not). Rather than trust a list of such tokenizers, the encoder checks itself when it
is made: probe texts with added tokens at the start, middle and end, with spaces and newlines around
them, must encode to the same ids both ways, else every text goes to the tokenizer whole (logged once).

A piece not seen before (a chat's new user line) is cut the same way one level down: a byte-level BPE
tokenizer splits a text into words by one regular expression (GPT-2's, or its `Split` pre-tokenizer's, as
Llama 3's) before any merge, and merges only within a word, so a piece's ids are its words' ids joined,
and a word seen before ("what", " the", " runbook") is looked up; one not seen before (a number, a name)
goes to the tokenizer's BPE model alone (`Model.tokenize`, public), as its pipeline would hand it. A call into `tokenizers` costs ~22 us of
CPU for a 20-token line on an idle core (15 of them its pre-tokenizer's Python objects), the words' regex
~4. Only a piece of printable ASCII (tabs and line breaks too) is cut here: `tokenizers` matches with
Oniguruma, whose Unicode tables are older than those of the `regex` module (thousands of code points one
calls letters or digits and the other does not), and the two disagree on ASCII's separators \x1c-\x1f;
on printable ASCII they agree. The same self-check guards it: where the probes disagree, or the
pre-tokenizer is not one of those two shapes (Qwen2's NFC normalizer, say), a new piece goes to the
tokenizer whole.

A new piece is first cut into lines, each looked up on its own: a completion's prompt holds no added
token, so its text is one piece, new whenever any line of it is ("{system}\n\n{question}", a few-shot
preamble, a document asked about again), and finding its words cost ~22 us of a 300-character prompt,
most of its encoding, for lines seen before. A line break followed by a character other than whitespace
always ends a word in both patterns (no word holds a line break and then anything else: the words that
hold one are whitespace, or end in line breaks; not so in every pattern, so only these two are cut), so
the words after it are the words of the text from there on. The line before it reads its last line break as followed by that character (GPT-2's pattern
cuts two line breaks before a letter in two, at the end of a text not), so its words are found with a
letter put after it and then dropped, and it is kept apart from the same text seen as a whole piece. The
last line is not kept apart (it is what differs from one prompt to the next); the whole piece is.
"""

from __future__ import annotations

import json
import logging
import re
import threading
from array import array
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import regex

log = logging.getLogger(__name__)

PROBE_CHARS = 256  # the self-check's probe texts are this long at least, as a system prompt's piece is
# What the cache keeps at most, counted as each piece's characters plus 4 per id (ids are kept as 4-byte
# array items) plus ENTRY_UNITS for the entry itself: about 30 MB for English text, up to twice that for
# text of 2-byte characters.
MAX_CACHED_UNITS = 16 << 20
# What an entry costs besides its text and ids (the key's and the array's object headers, the ordered
# dict's node: ~230 bytes for a short line, by tracemalloc), so that many short lines stay in the bound too.
ENTRY_UNITS = 200

_PROBE_WORDS = (
    " The café's 12 ships   sailed\n\n  past, the  cape;\t\t日本語 émigrés  "
    "they'll don't 1,234.50 ?!... (x)  \n \u00a0 ١٢٣ ﬁne  "
)
# Plain ASCII (cut into lines and words): line breaks before letters, digits, quotes, punctuation and more
# line breaks, and after spaces, tabs, a carriage return and punctuation.
_PROBE_LINES = (
    "A line.\nTwo words\n\nThree  \n\tTab\n'quoted' it's\n12,5\n \nX\r\nY\n\n\nZ?\n(x)\n-\nx;\n// y\n/z\n"
)

# A word as GPT-2's byte-level pre-tokenizer cuts one (tokenizers' ByteLevel with use_regex).
GPT2_WORDS = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
# Llama 3's Split pattern (its tokenizer.json).
LLAMA3_WORDS = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)
# The same two patterns for a plain piece, with ASCII classes for `\p{L}` and `\p{N}` (on printable ASCII,
# tabs and line breaks they match the same characters), in `re`, which finds them in half `regex`'s time.
PLAIN_WORDS = {
    GPT2_WORDS: r"""'s|'t|'re|'ve|'m|'ll|'d| ?[A-Za-z]+| ?[0-9]+| ?[^\sA-Za-z0-9]+|\s+(?!\S)|\s+""",
    LLAMA3_WORDS: r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\nA-Za-z0-9]?[A-Za-z]+|[0-9]{1,3}| ?[^\sA-Za-z0-9]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+",
}
# The patterns a new piece is cut into lines for: in each, no word holds a line break and then anything but
# whitespace (the module's docstring). Others do: tiktoken's o200k, say, ends punctuation in [\r\n/]*.
LINE_SAFE_WORDS = frozenset((GPT2_WORDS, LLAMA3_WORDS))
# What the word cache does not cut: anything but printable ASCII, tabs and line breaks (the module's docstring)
_NOT_PLAIN = re.compile(r"[^\t\n\r\x20-\x7e]")
MAX_WORD_CHARS = 64  # a longer word (no spaces in a long run) is tokenized, not kept
MAX_WORDS = 200_000  # words kept at most (~40 MB); past it the word cache starts again
# GPT-2's byte-level characters (`bytes_to_unicode`) for the bytes a plain word may hold: a printable ASCII
# byte is its own, and each byte it does not keep, tab, line breaks and the space among them, is moved to
# 256 + its order among those (the first 33 bytes in order: 256 + the byte).
_BYTE_LEVEL = str.maketrans({b: chr(256 + b) for b in (0x09, 0x0A, 0x0D, 0x20)})
# Where a new piece is cut into lines: after a line break, before anything but whitespace.
_LINE_STARTS = re.compile(r"(?<=\n)(?=\S)")
# A line's key in the piece cache, as it reads with more text after it: NUL, which no plain piece holds
_FOLLOWED = "\x00"


class _Gaps(Exception):
    """The words pattern skipped some of a line (a Split keeps its gaps as words, and a gap may run on over
    the line's end): the cut into lines does not hold, the piece is tokenized whole."""


class SegmentTokenizer:
    def __init__(self, tokenizer: Any, max_units: int = MAX_CACHED_UNITS) -> None:
        self.tokenizer = tokenizer
        self._max_units = max_units
        self._cache: OrderedDict[str, array[int]] = OrderedDict()
        self._units = 0
        self._lock = threading.Lock()  # the router's prompt pool encodes from several threads
        self._backend: Any = getattr(tokenizer, "backend_tokenizer", None)  # a `tokenizers.Tokenizer`
        self._added: dict[str, int] = {}
        self._probe_names: list[str] = []  # added tokens the self-check puts in its probes (special or not)
        self._split: re.Pattern[str] | None = None
        self._special_ends: tuple[list[int], list[int]] | None = None
        self._words: Any = None  # a `regex` pattern cutting a piece into its words; None: pieces whole
        self._word_ids: dict[str, array[int]] = {}
        self._cut_lines = False  # a new piece cut into lines first (LINE_SAFE_WORDS)
        self._model: Any = None  # the tokenizer's model (`tokenizers.models.BPE` where words are cut)
        # With dropout (a BPE's) the ids of a text are drawn anew on each call: none may be kept.
        if self._backend is not None and not _drops_out(self._backend) and self._plain_added_tokens():
            self._model = self._backend.model
            self._words = _word_pattern(self._backend)
            self._cut_lines = self._words is not None and self._words.pattern in LINE_SAFE_WORDS
            if self._words is not None and self._words.pattern in PLAIN_WORDS:
                # only plain pieces are cut into words (`_encode_piece`); the self-check below holds it
                self._words = re.compile(PLAIN_WORDS[self._words.pattern])
            if self._words is not None and not self._agrees():
                log.info("tokenizer %s: words are not cached", type(tokenizer).__name__)
                self._words = None
            if self._words is None and not self._agrees():
                self._split = None
        if self._split is not None:
            self._special_ends = self._specials_around()
        else:
            log.info("tokenizer %s: pieces between added tokens are not cached", type(tokenizer).__name__)

    @property
    def caching(self) -> bool:
        return self._split is not None

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """`tokenizer.encode(text, add_special_tokens=...)`, the same ids."""
        if self._split is None or (add_special_tokens and self._special_ends is None):
            # a transformers tokenizer (Any): encode gives the ids
            ids: list[int] = self.tokenizer.encode(text, add_special_tokens=add_special_tokens)
            return ids
        ids = self._pieces(text)
        if add_special_tokens:
            assert self._special_ends is not None  # checked above
            before, after = self._special_ends
            return before + ids + after
        return ids

    def _plain_added_tokens(self) -> bool:
        tokens = self._backend.get_added_tokens_decoder().values()
        if any(t.lstrip or t.rstrip or t.single_word or t.normalized for t in tokens):
            return False
        if getattr(self._backend, "encode_special_tokens", False):  # special tokens split like text
            return False
        self._probe_names = [t.content for t in tokens if t.special][:2] + [
            t.content for t in tokens if not t.special
        ][:2]
        self._added = {t.content: self._backend.token_to_id(t.content) for t in tokens if t.content}
        if not self._added:
            return False
        # Longest first: at each position the first alternative that matches wins, which makes the split
        # leftmost-longest, as the tokenizer's own matcher cuts it.
        names = sorted(self._added, key=len, reverse=True)
        self._split = re.compile("(" + "|".join(map(re.escape, names)) + ")")
        return True

    def _pieces(self, text: str) -> list[int]:
        ids: list[int] = []
        assert self._split is not None  # only called when caching
        for i, piece in enumerate(self._split.split(text)):
            if i % 2:  # an added token (the split keeps them at odd places)
                ids.append(self._added[piece])
            elif _FOLLOWED in piece:  # never kept: it could be taken for a line's key (a client may send NUL)
                ids += self._tokenized(piece)
            elif piece:
                # Short ones too: under load a call into the tokenizer cost 20-150 us even for "assistant\n"
                # (the template's own text between its tokens, in every chat), a lookup ~1 us, and a
                # question asked again (an RL group's prompt, a benchmark's) is not tokenized again.
                ids += self._cached(piece)
        return ids

    def _cached(self, key: str, encode: Callable[[str], array[int]] | None = None) -> array[int]:
        """The ids of `key` (a piece, or a line's key), from the cache or `encode`d (a piece's by default)."""
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                return hit
        ids = (encode or self._encode_piece)(key)  # outside the lock: slow
        units = len(key) + 4 * len(ids) + ENTRY_UNITS
        if units > self._max_units:
            return ids
        with self._lock:
            if key not in self._cache:
                self._cache[key] = ids
                self._units += units
                while self._units > self._max_units:
                    old, old_ids = self._cache.popitem(last=False)
                    self._units -= len(old) + 4 * len(old_ids) + ENTRY_UNITS
        return ids

    def _tokenized(self, text: str) -> array[int]:
        return array("I", self._backend.encode(text, add_special_tokens=False).ids)

    def _encode_piece(self, piece: str) -> array[int]:
        words = self._words
        if words is None or not piece.isascii() or _NOT_PLAIN.search(piece):
            return self._tokenized(piece)
        if not self._cut_lines:
            return self._encode_words(piece)
        *lines, last = _LINE_STARTS.split(piece)
        if not lines:
            return self._encode_words(piece)
        # each line looked up on its own (the module's docstring)
        ids: array[int] = array("I")
        try:
            for line in lines:
                ids += self._cached(line + _FOLLOWED, self._encode_followed_line)
        except _Gaps:
            return self._tokenized(piece)
        return ids + self._encode_words(last)

    def _encode_followed_line(self, key: str) -> array[int]:
        """A line's ids as it reads with more text after it, from its key (the line, then `_FOLLOWED`)."""
        line = key[: -len(_FOLLOWED)]
        found = self._words.findall(line + "x")
        if found[-1:] != ["x"] or sum(map(len, found)) != len(line) + 1:
            raise _Gaps
        return self._word_list_ids(found[:-1])

    def _encode_words(self, piece: str) -> array[int]:
        found = self._words.findall(piece)
        if sum(map(len, found)) != len(piece):  # the pattern skipped some of it (a Split keeps gaps): whole
            return self._tokenized(piece)
        return self._word_list_ids(found)

    def _word_list_ids(self, found: list[str]) -> array[int]:
        ids: array[int] = array("I")
        cache = self._word_ids
        model = self._model
        for word in found:
            word_ids = cache.get(word)
            if word_ids is None:
                # A word goes to the BPE model alone, as the tokenizer hands it each word its pre-tokenizer
                # found, in byte-level characters: a third of a call to `encode` (~2 us against ~6 on an idle
                # core), which wraps the model in the whole pipeline, Python objects and all.
                word_ids = array("I", [t.id for t in model.tokenize(word.translate(_BYTE_LEVEL))])
                if len(word) <= MAX_WORD_CHARS:
                    if len(cache) >= MAX_WORDS:
                        cache.clear()  # (threads: a dict's clear and set are atomic; a lost entry costs a call)
                    cache[word] = word_ids
            ids += word_ids
        return ids

    def _probes(self) -> list[str]:
        names = [n for n in self._probe_names if n]
        words = _PROBE_WORDS * (PROBE_CHARS // len(_PROBE_WORDS) + 1)
        bare = words.strip()  # a word right after an added token, where a first-piece-only prefix shows
        lines = _PROBE_LINES * (PROBE_CHARS // len(_PROBE_LINES) + 1)
        out = [words, bare, lines, lines.strip()]
        for name in names:
            out += [name + words, name + bare, words + name, bare + name + bare, f"{name}\n{words}{name}\n"]
            out.append(f"{name} {name}")
            out += [name + lines, lines + name + lines]
        out.append("".join(names) + words + " ".join(names) + "\n" + words)
        return out

    def _agrees(self) -> bool:
        """Each probe tokenized by pieces as by the tokenizer itself (the cache is cleared after)."""
        try:
            ok = all(
                self._pieces(p) == self.tokenizer.encode(p, add_special_tokens=False) for p in self._probes()
            )
        finally:
            self._cache.clear()
            self._word_ids.clear()
            self._units = 0
        return ok

    def _specials_around(self) -> tuple[list[int], list[int]] | None:
        """The ids `add_special_tokens=True` puts before and after a text's (a BOS, an EOS), if every probe
        shows the same ones; else None (such texts go to the tokenizer whole)."""
        probes = self._probes()
        plain = self.tokenizer.encode(probes[0], add_special_tokens=False)
        full = self.tokenizer.encode(probes[0], add_special_tokens=True)
        for start in range(len(full) - len(plain) + 1):
            if full[start : start + len(plain)] == plain:
                before, after = full[:start], full[start + len(plain) :]
                break
        else:
            return None
        for p in probes[1:]:
            if before + self.tokenizer.encode(p, add_special_tokens=False) + after != self.tokenizer.encode(
                p, add_special_tokens=True
            ):
                return None
        return before, after


def _drops_out(backend: Any) -> bool:
    """Whether the tokenizer's model drops merges at random (BPE's dropout)."""
    try:
        return bool((json.loads(backend.to_str()).get("model") or {}).get("dropout"))
    except (ValueError, AttributeError):
        return True  # a configuration it does not show: nothing is kept


def _word_pattern(backend: Any) -> Any:
    """The regular expression that cuts a text into the words a byte-level BPE tokenizer merges within,
    read from its configuration: ByteLevel with use_regex (GPT-2's), or a Split of one pattern, isolated,
    then ByteLevel without (Llama 3's). None for any other shape, or a normalizer (it would change the text
    before the cut: Qwen2's NFC)."""
    try:
        config = json.loads(backend.to_str())
    except (ValueError, AttributeError):
        return None
    pre = config.get("pre_tokenizer") or {}
    if config.get("normalizer") is not None or config.get("model", {}).get("type") != "BPE":
        return None
    pattern = None
    if pre.get("type") == "ByteLevel" and pre.get("use_regex") and not pre.get("add_prefix_space"):
        pattern = GPT2_WORDS
    elif pre.get("type") == "Sequence":
        steps = pre.get("pretokenizers") or []
        if (
            len(steps) == 2
            and steps[0].get("type") == "Split"
            and steps[0].get("behavior") == "Isolated"
            and not steps[0].get("invert")
            and isinstance((steps[0].get("pattern") or {}).get("Regex"), str)
            and steps[1].get("type") == "ByteLevel"
            and not steps[1].get("use_regex")
            and not steps[1].get("add_prefix_space")
        ):
            pattern = steps[0]["pattern"]["Regex"]
    if pattern is None:
        return None
    try:
        compiled = regex.compile(pattern)
    except regex.error:
        return None
    return compiled if compiled.groups == 0 else None  # with groups, findall would give the groups' text
