"""One choice as it grows: engine outputs become deltas (detokenized with the prompt as context, cut at
stop strings, logprobs as token texts), and logprobs take OpenAI's completion or chat shape."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, cast

from kvpilot.daemon.engine.outputs import RequestOutput, TokenLogprob
from kvpilot.daemon.server.detokenizer import IncrementalDetokenizer, StopStrings
from kvpilot.protocol import JSONObject

# One logprob as the API shows it: the token's text, its logprob (None for a prompt's first token)
# and the most likely alternatives.
LogprobEntry = tuple[str, float | None, list[tuple[str, float]] | None]


@dataclass(slots=True)
class PromptEcho:
    """The prompt as `echo` returns it: its text, and its logprobs once the engine has sent them."""

    text: str
    logprobs: list[LogprobEntry] | None = None


@dataclass(slots=True)
class Delta:
    """What one engine output adds to one choice."""

    index: int  # the sequence's index within its prompt's group
    text: str
    logprobs: list[LogprobEntry] | None
    finish_reason: str | None
    output: RequestOutput
    echo: PromptEcho | None = None  # the prompt, on a choice's first delta


@dataclass(slots=True)
class Sequence:
    detok: IncrementalDetokenizer
    stops: StopStrings
    started: bool = False
    done: bool = False


@dataclass(slots=True)
class Choice:
    text: str = ""
    logprobs: list[LogprobEntry] = field(default_factory=list)
    finish_reason: str | None = None
    output: RequestOutput | None = None


class TokenTexts:
    """Token ids as text, for logprobs; cached, as the vocabulary bounds the cache. Call in the text pool."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._texts: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._texts.get(token_id)
        if text is None:
            text = self._texts[token_id] = self._tokenizer.decode([token_id], skip_special_tokens=False)
        return text


def feed(
    texts: TokenTexts,
    seqs: list[Sequence],
    outputs: list[RequestOutput],
    prompt: list[int],
    echo: PromptEcho | None,
) -> list[Delta]:
    """Detokenize engine outputs into deltas (in the text pool)."""
    deltas = []
    for out in outputs:
        seq = seqs[out.index]
        if out.prompt_logprobs is not None and echo is not None:
            first = (texts(prompt[0]), None, None)
            # only the prompt's first token has no logprob
            rest = cast(list[TokenLogprob], out.prompt_logprobs[1:])
            echo.logprobs = [first, *(entry(texts, lp) for lp in rest)]
        text, stopped = seq.stops.feed(seq.detok.push(out.new_token_ids, out.finished), out.finished)
        reason = "stop" if stopped else out.finish_reason if out.finished else None
        seq.done = reason is not None
        logprobs = [entry(texts, lp) for lp in out.logprobs] if out.logprobs is not None else None
        delta = Delta(out.index, text, logprobs, reason, out)
        if echo is not None and not seq.started:
            delta.echo = PromptEcho(echo.text, echo.logprobs)
        seq.started = True
        deltas.append(delta)
    return deltas


def entry(texts: TokenTexts, lp: TokenLogprob) -> LogprobEntry:
    top = [(texts(t), v) for t, v in lp.top]
    return texts(lp.token_id), lp.logprob, top


def completion_logprobs(entries: list[LogprobEntry], offset: int = 0) -> JSONObject:
    out: dict[str, list[object]] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for token, logprob, top in entries:
        out["tokens"].append(token)
        out["token_logprobs"].append(logprob)
        out["top_logprobs"].append(None if top is None else dict(top))
        out["text_offset"].append(offset)
        offset += len(token)
    return out


def chat_logprobs(entries: list[LogprobEntry]) -> JSONObject:
    def item(token: str, logprob: float | None) -> JSONObject:
        return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8"))}

    return {
        "content": [
            {**item(token, logprob), "top_logprobs": [item(t, v) for t, v in top or ()]}
            for token, logprob, top in entries
        ]
    }
