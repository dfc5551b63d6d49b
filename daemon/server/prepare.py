"""A request body becomes prompts of token ids: parsed, validated, templated and tokenized. Runs in the
text pool, off the event loop."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from kvpilot.daemon.engine.request import SamplingParams
from kvpilot.daemon.server.app_state import ServerState
from kvpilot.daemon.server.errors import bad
from kvpilot.daemon.server.protocol import GenerateRequest, parse_chat, parse_completion, parse_json_object


@dataclass(slots=True)
class Prepared:
    """A parsed and tokenized request."""

    req: GenerateRequest
    prompts: list[list[int]]
    prompt_texts: list[str]  # for echo
    chat: bool


def prepare_completion(state: ServerState, raw: bytes) -> Prepared:
    req = parse_completion(parse_json_object(raw), state.served)
    tok = state.engine.tokenizer
    texts = [p for p in req.prompts if isinstance(p, str)]
    for text in texts:
        _check_chars(state, text, "prompt")
    # A batch call: the Rust tokenizer releases the GIL for it, so the event loop keeps running.
    encoded = iter(tok(texts, add_special_tokens=True)["input_ids"] if texts else ())
    prompts = [list(next(encoded)) if isinstance(p, str) else p for p in req.prompts]
    echoed = [(p if isinstance(p, str) else _decode(tok, p)) if req.echo else "" for p in req.prompts]
    return Prepared(req, prompts, echoed, chat=False)


def prepare_chat(state: ServerState, raw: bytes) -> Prepared:
    chat = parse_chat(parse_json_object(raw), state.served)
    tok = state.engine.tokenizer
    try:
        text = tok.apply_chat_template(
            chat.messages, tokenize=False, add_generation_prompt=chat.add_generation_prompt
        )
    except Exception as exc:  # noqa: BLE001 - template errors (e.g. role order) are the client's input
        raise bad(f"the messages do not fit the model's chat template: {exc}", "messages") from None
    _check_chars(state, text, "messages")
    ids = list(tok([text], add_special_tokens=False)["input_ids"][0])
    return Prepared(chat.generate, [ids], [""], chat=True)


def _check_chars(state: ServerState, text: str, param: str) -> None:
    """Refuse a text that is too long for the context without tokenizing it: no token covers more than
    `max_token_chars` characters, so more characters than that times the context is surely too long."""
    limit = state.engine.max_model_len
    if len(text) > state.max_prompt_chars:
        raise bad(
            f"This model's maximum context length is {limit} tokens; the {param} has {len(text)} "
            f"characters, more than {limit} tokens can hold",
            param,
            code="context_length_exceeded",
        )


def _decode(tok: Any, ids: list[int]) -> str:
    try:
        return tok.decode(ids)
    except (OverflowError, IndexError, TypeError, ValueError):
        return ""  # ids outside the vocabulary: the engine refuses the prompt with a 400 right after


def params_for(state: ServerState, prep: Prepared, prompt: list[int]) -> SamplingParams:
    """The prompt's own parameters: without max_tokens, what fits beside this prompt (not the
    batch's shortest room); the engine checks the context for everything else."""
    params = dataclasses.replace(prep.req.params)
    if not prep.req.max_tokens_given:
        room = state.engine.max_model_len - len(prompt)
        params.max_tokens = max(1, room if prep.chat else min(params.max_tokens, room))
        params.min_tokens = min(params.min_tokens, params.max_tokens)
    return params
