"""Streaming detokenization of a SentencePiece tokenizer keeps word-initial spaces: the first output
token is decoded with the prompt's last tokens as context. The tokenizer is trained by the test."""

from __future__ import annotations

import io
from pathlib import Path

import pytest

from kvpilot.daemon.server.detokenizer import IncrementalDetokenizer

CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "a paged cache keeps keys and values of every layer in blocks",
    "prefix caching lets prompts that share a beginning skip its computation",
    "the operator flushes every cache of a fleet when the weights change",
    "héllo wörld: naïve café über straße",
] * 20


@pytest.fixture(scope="module")
def sp_tokenizer(tmp_path_factory: pytest.TempPathFactory):  # noqa: ANN201
    spm = pytest.importorskip("sentencepiece", reason="the test extra installs sentencepiece")
    from transformers import LlamaTokenizer

    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(CORPUS),
        model_writer=model,
        vocab_size=400,
        model_type="bpe",
        minloglevel=2,
        byte_fallback=True,
        character_coverage=1.0,
    )
    path = Path(tmp_path_factory.mktemp("spm")) / "tokenizer.model"
    path.write_bytes(model.getvalue())
    return LlamaTokenizer(vocab_file=str(path), legacy=False, add_bos_token=False)


@pytest.mark.parametrize("text", ["the lazy dog jumps", " over blocks of keys", " naïve café straße ✓"])
def test_streamed_text_equals_the_full_decode(sp_tokenizer, text: str) -> None:  # noqa: ANN001
    tok = sp_tokenizer
    prompt = tok.encode("prefix caching lets prompts", add_special_tokens=False)
    output = tok.encode(text, add_special_tokens=False)
    full = tok.decode(prompt + output)
    want = full[len(tok.decode(prompt)) :]
    detok = IncrementalDetokenizer(tok, prompt)
    streamed = "".join(detok.push([t], final=i == len(output) - 1) for i, t in enumerate(output))
    assert streamed == want
    assert streamed.startswith(" ") == want.startswith(" ")
    # Without the prompt's context the first word loses its space: the bug this guards against.
    if want.startswith(" "):
        alone = IncrementalDetokenizer(tok)
        assert "".join(alone.push([t], final=i == len(output) - 1) for i, t in enumerate(output)) != want
