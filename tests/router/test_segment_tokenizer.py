"""The router's SegmentTokenizer gives exactly the ids of the tokenizer it wraps: the default model's real
tokenizer on chats rendered by its own template and on random texts full of added tokens; and a tokenizer
whose pieces do not tokenize alike apart (Metaspace's prefix on the first piece only) is caught by the
self-check and served whole. New pieces are cut into words by the tokenizer's own pattern (GPT-2's, or a
Split pre-tokenizer's as Llama 3's and Qwen's), exact on random texts; a pattern that skips characters has
its pieces tokenized whole."""

from __future__ import annotations

import json
import random

import pytest
from tokenizers import Regex, Tokenizer, models, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from kvpilot.default_model import ensure_default_model
from kvpilot.router.routing.segment_tokenizer import GPT2_WORDS, LLAMA3_WORDS, PLAIN_WORDS, SegmentTokenizer

WORDS = [
    "the",
    "ship",
    " ",
    "  ",
    "\n",
    "\n\n",
    "café",
    "日本",
    "12",
    "3.5",
    "'s",
    "!",
    "\t",
    "émigré",
    "cape",
]


@pytest.fixture(scope="module")
def smollm():
    return AutoTokenizer.from_pretrained(ensure_default_model())


def random_text(rng: random.Random, added: list[str], n: int) -> str:
    return "".join(
        rng.choice(added) if added and rng.random() < 0.08 else rng.choice(WORDS) for _ in range(n)
    )


def test_the_default_models_tokenizer_is_cached_and_exact(smollm) -> None:  # noqa: ANN001
    enc = SegmentTokenizer(smollm)
    assert enc.caching and enc._words is not None  # GPT-2's byte-level words, matched with `re` (plain ASCII)
    assert enc._words.pattern == PLAIN_WORDS[GPT2_WORDS]
    added = list(smollm.get_added_vocab())
    rng = random.Random(7)
    system = "You are the assistant of a bike shop. " * 12
    for i in range(200):
        text = random_text(rng, added, rng.randrange(1, 400))
        for specials in (False, True):
            assert enc.encode(text, specials) == smollm.encode(text, add_special_tokens=specials), (i, text)
        messages = [
            {"role": "system", "content": system},
            {"role": "user", "content": random_text(rng, [], 20)},
        ]
        chat = smollm.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert enc.encode(chat) == smollm.encode(chat, add_special_tokens=False), chat
    # The system prompt's piece is kept once, however many chats carried it; its words too.
    assert sum(system in piece for piece in enc._cache) == 1
    assert {" bike", " shop", "\n"} <= set(enc._word_ids)


def test_a_new_prompts_lines_seen_before_are_looked_up_and_exact(smollm) -> None:  # noqa: ANN001
    """A completion's prompt is one piece (no added token in it), new whenever its last line is: its lines
    before that are cut at each line start and found again, as a whole piece would be."""
    enc = SegmentTokenizer(smollm)
    preamble = "You fix bikes.\nAnswer briefly.\n\nExamples:\nQ: Brakes?\nA: Yes.\n  Indented.\n"
    rng = random.Random(5)
    ascii_words = [w for w in WORDS if w.isascii()]
    for i in range(100):
        question = "".join(rng.choice(ascii_words) for _ in range(rng.randrange(1, 30)))
        text = f"{preamble}\n{question} {i}?"
        assert enc.encode(text, True) == smollm.encode(text, add_special_tokens=True), (i, text)
    # Each line of the preamble kept once, as read with more text after it (an indented line goes with
    # the line before it: only a line break before something other than whitespace starts a line).
    lines = [
        "You fix bikes.\n",
        "Answer briefly.\n\n",
        "Examples:\n",
        "Q: Brakes?\n",
        "A: Yes.\n  Indented.\n\n",
    ]
    assert {line + "\x00" for line in lines} <= set(enc._cache)


def test_the_cache_keeps_to_its_bound(smollm) -> None:  # noqa: ANN001
    chars = 256
    enc = SegmentTokenizer(smollm, max_units=4 * 2 * chars)  # about 4 pieces of text and ids
    pieces = [f"{i} " + "word " * (chars // 5) for i in range(10)]
    for p in pieces:
        assert enc.encode(p) == smollm.encode(p, add_special_tokens=False)
    assert 2 <= len(enc._cache) <= 4 and enc._units <= 8 * chars
    assert pieces[-1] in enc._cache and pieces[0] not in enc._cache  # least recently used went first


def test_a_tokenizer_whose_pieces_differ_apart_is_served_whole() -> None:
    # Its probes start with "The": the text's first piece tokenizes as "▁The", one after "<s>" as "The".
    vocab = {"<unk>": 0, "<s>": 1, "▁The": 2, "The": 3, "▁ship": 4, "ship": 5}
    raw = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tok = PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="<unk>", bos_token="<s>")
    tok.add_special_tokens({"additional_special_tokens": ["<s>"]})
    enc = SegmentTokenizer(tok)
    assert not enc.caching
    text = "The ship<s>The ship"
    assert enc.encode(text) == tok.encode(text, add_special_tokens=False) == [2, 4, 1, 3, 4]
    # What a piece tokenized on its own gives, had the cache been trusted:
    assert tok.encode("The ship", add_special_tokens=False) == [2, 4]


# Llama 3's pre-tokenizer pattern (LLAMA3_WORDS), with a byte-level BPE trained here on a few lines.


def split_bpe(pattern: str, texts: tuple[str, ...] = ()) -> PreTrainedTokenizerFast:
    raw = Tokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<|begin|>", "<|end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    rng = random.Random(3)
    # with the texts the regex engines cut apart (below), so merges across their cuts are learnt
    odd = ["see \ua7ce. and the ship"] * 50 + ["the\x1c ship  \x1f cape"] * 50 + list(texts) * 50
    raw.train_from_iterator([random_text(rng, [], 60) for _ in range(200)] + odd, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=raw, bos_token="<|begin|>", eos_token="<|end|>")


@pytest.mark.parametrize("skips", [False, True])
def test_a_split_pre_tokenizers_words_are_cached_and_exact(skips: bool) -> None:
    """Llama 3's pattern cuts every character into some word: words are cached. One that matches only
    letters leaves gaps (which a Split keeps as pieces of their own): such a piece is tokenized whole."""
    tok = split_bpe(r"\p{L}+" if skips else LLAMA3_WORDS)
    enc = SegmentTokenizer(tok)
    assert enc.caching and enc._words is not None
    rng = random.Random(11)
    ascii_words = [w for w in WORDS if w.isascii()]
    for i in range(300):
        words = WORDS if i % 2 else ascii_words  # a piece with a character past ASCII is tokenized whole
        text = "".join(
            rng.choice(["<|begin|>", "<|end|>"]) if rng.random() < 0.08 else rng.choice(words)
            for _ in range(rng.randrange(1, 200))
        )
        assert enc.encode(text) == tok.encode(text, add_special_tokens=False), (i, text)
    # Characters the two regex engines class apart: U+A7CE, a letter to the `regex` module's Unicode tables
    # and unassigned in Oniguruma's (tokenizers'); \x1c, a space to Oniguruma and not to `regex`.
    for text in ("see \ua7ce. and the ship", "the\x1c ship  \x1f cape"):
        assert enc.encode(text) == tok.encode(text, add_special_tokens=False), text
    # Letters-only pieces have no gaps: cut into words by either pattern. Others: only by Llama 3's.
    assert enc._word_ids and any(not w.isalpha() for w in enc._word_ids) is not skips


# tiktoken's o200k shape: punctuation takes the line breaks and slashes after it, so a word runs on over a
# line start (";\n//").
RUNS_ON_WORDS = r"[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"


def test_a_pattern_whose_words_run_over_a_line_start_has_its_pieces_cut_into_words_only() -> None:
    tok = split_bpe(RUNS_ON_WORDS, ("x = 1;\n// note",))
    text = "y = 2;\n// other\nz"
    # what cutting at the line start would give, wrongly: ";\n" and "//" apart, where the tokenizer merges
    assert tok.encode(text, add_special_tokens=False) != tok.encode(
        "y = 2;\n", add_special_tokens=False
    ) + tok.encode("// other\nz", add_special_tokens=False)
    enc = SegmentTokenizer(tok)
    assert enc.caching and enc._words is not None and not enc._cut_lines
    for t in (text, "x = 1;\n// note\n" + text):
        assert enc.encode(t) == tok.encode(t, add_special_tokens=False), t


def test_a_piece_holding_nul_is_never_taken_for_a_line(smollm) -> None:  # noqa: ANN001
    """A line is kept under its text and a NUL; a client's piece of that text is tokenized, not kept, in
    either order."""
    for texts in (
        ["Hello world\n\x00", "Hello world\nHow are you?"],
        ["Hello world\nHow are you?", "Hello world\n\x00"],
    ):
        enc = SegmentTokenizer(smollm)
        for text in texts:
            assert enc.encode(text) == smollm.encode(text, add_special_tokens=False), (texts, text)


def test_a_bpe_with_dropout_keeps_nothing(smollm) -> None:  # noqa: ANN001
    """With dropout, a text's ids are drawn anew on each call: no piece or word may be kept (or a word looked
    up in the model alone), whatever the self-check's draws happened to agree on."""
    config = json.loads(smollm.backend_tokenizer.to_str())
    config["model"]["dropout"] = 0.5
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(json.dumps(config)))
    enc = SegmentTokenizer(tok)
    assert not enc.caching and enc._words is None
    assert SegmentTokenizer(smollm).caching
