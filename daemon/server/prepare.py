"""A request body becomes prompts of token ids, each with its sampling parameters: parsed, validated,
templated and tokenized. Runs in the text pool, off the event loop."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from kvpilot.daemon.engine.client import EngineInfo
from kvpilot.daemon.engine.request import SamplingParams
from kvpilot.protocol.errors import bad
from kvpilot.protocol.requests import (
    ChatRequest,
    GenerateRequest,
    parse_chat,
    parse_completion,
    parse_json_object,
)

# No token of a vocabulary decodes to more characters than its longest entry; 4x covers normalizers
# that shrink text before splitting it (NFKC and friends).
CHARS_PER_TOKEN_MARGIN = 4


@dataclass(frozen=True, slots=True)
class PromptRules:
    """What preparing a request needs: the model names served and the engine's tokenizer and context."""

    served: list[str]
    info: EngineInfo
    max_prompt_chars: int  # longer prompt texts cannot fit the context, whatever their tokens
    adapters: frozenset[str]  # the LoRA adapters a request may name as its model

    @classmethod
    def of(cls, info: EngineInfo, served: list[str]) -> PromptRules:
        longest = max((len(t) for t in info.tokenizer.get_vocab()), default=1)
        chars = CHARS_PER_TOKEN_MARGIN * max(longest, 1) * info.max_model_len
        return cls(served, info, chars, frozenset(info.lora_adapters))


@dataclass(slots=True)
class Prepared:
    """A parsed and tokenized request."""

    req: GenerateRequest
    prompts: list[list[int]]
    params: list[SamplingParams]  # each prompt's own
    prompt_texts: list[str]  # for echo
    chat: bool


def prepare_completion(rules: PromptRules, raw: bytes) -> Prepared:
    req = parse_completion(parse_json_object(raw), rules.served, rules.adapters)
    tok = rules.info.tokenizer
    texts = [p for p in req.prompts if isinstance(p, str)]
    for text in texts:
        _check_chars(rules, text, "prompt")
    # A batch call: the Rust tokenizer releases the GIL for it, so the event loop keeps running.
    encoded = iter(tok(texts, add_special_tokens=True)["input_ids"] if texts else ())
    prompts = [list(next(encoded)) if isinstance(p, str) else p for p in req.prompts]
    echoed = [(p if isinstance(p, str) else _decode(tok, p)) if req.echo else "" for p in req.prompts]
    params = [_params_for(req, False, p, rules.info.max_model_len) for p in prompts]
    return Prepared(req, prompts, params, echoed, chat=False)


def prepare_chat(rules: PromptRules, raw: bytes) -> Prepared:
    chat = parse_chat(parse_json_object(raw), rules.served, rules.adapters)
    tok = rules.info.tokenizer
    ids = list(tok([_chat_text(rules, chat)], add_special_tokens=False)["input_ids"][0])
    params = _params_for(chat.generate, True, ids, rules.info.max_model_len)
    return Prepared(chat.generate, [ids], [params], [""], chat=True)


def _chat_text(rules: PromptRules, chat: ChatRequest) -> str:
    """The chat rendered with the model's template, its length checked."""
    try:
        text = chat.prompt.render(rules.info.tokenizer)
    except Exception as exc:  # noqa: BLE001 - template errors (e.g. role order) are the client's input
        raise bad(f"the messages do not fit the model's chat template: {exc}", "messages") from None
    _check_chars(rules, text, "messages")
    return text


@dataclass(slots=True)
class Tokenized:
    """vLLM's `/tokenize` reply, and the request's ignored fields for its header."""

    body: dict[str, Any]
    ignored_fields: list[str]


# vLLM's /tokenize fields beside those of a generation request; defaults as vLLM's: the chat template
# brings its own special tokens, a bare prompt gets the tokenizer's (what generation does with each).
_TOKENIZE_FIELDS = ("add_special_tokens", "return_token_strs")


def prepare_tokenize(rules: PromptRules, raw: bytes) -> Tokenized:
    """vLLM's `POST /tokenize`: `{"prompt"}` or `{"messages"}` parsed, templated and tokenized exactly as
    the completion or chat request with the same fields would be, so a router keys the blocks it will hit."""
    body = parse_json_object(raw)
    chat_form = "messages" in body
    own = {name: body.pop(name, None) for name in _TOKENIZE_FIELDS}
    for name, value in own.items():
        if value is not None and not isinstance(value, bool):
            raise bad(f"'{name}' must be a boolean", name)
    tok = rules.info.tokenizer
    if chat_form:
        chat = parse_chat(body, rules.served, rules.adapters)
        req = chat.generate
        text = _chat_text(rules, chat)
        special = own["add_special_tokens"] is True
    else:
        if not isinstance(body.get("prompt"), str):
            raise bad("'prompt' must be a string (or send 'messages' to tokenize a chat)", "prompt")
        req = parse_completion(body, rules.served, rules.adapters)
        text = body["prompt"]
        _check_chars(rules, text, "prompt")
        special = own["add_special_tokens"] is not False
    ids = list(tok([text], add_special_tokens=special)["input_ids"][0])
    strs = tok.convert_ids_to_tokens(ids) if own["return_token_strs"] else None
    reply = {"count": len(ids), "max_model_len": rules.info.max_model_len, "tokens": ids, "token_strs": strs}
    return Tokenized(reply, req.ignored_fields)


def _check_chars(rules: PromptRules, text: str, param: str) -> None:
    """Refuse a text that is too long for the context without tokenizing it: no token covers more
    characters than the margin times the longest vocabulary entry, so more characters than that times
    the context is surely too long."""
    limit = rules.info.max_model_len
    if len(text) > rules.max_prompt_chars:
        raise bad(
            f"This model's maximum context length is {limit} tokens; the {param} has {len(text)} "
            f"characters, more than {limit} tokens can hold",
            param,
            code="context_length_exceeded",
        )


def _decode(tok: Any, ids: list[int]) -> str:
    try:
        text: str = tok.decode(ids)  # a transformers tokenizer (Any)
        return text
    except (OverflowError, IndexError, TypeError, ValueError):
        return ""  # ids outside the vocabulary: the engine refuses the prompt with a 400 right after


def _params_for(req: GenerateRequest, chat: bool, prompt: list[int], max_model_len: int) -> SamplingParams:
    """The prompt's own engine parameters, from what the client asked (the one place the protocol's
    `Sampling` becomes the engine's `SamplingParams`): without max_tokens, what fits beside this prompt
    (not the batch's shortest room); the engine checks the context for everything else."""
    params = SamplingParams(**{f.name: getattr(req.params, f.name) for f in dataclasses.fields(req.params)})
    if not req.max_tokens_given:
        room = max_model_len - len(prompt)
        params.max_tokens = max(1, room if chat else min(params.max_tokens, room))
        params.min_tokens = min(params.min_tokens, params.max_tokens)
    return params
