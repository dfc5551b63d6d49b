"""OpenAI request parsing: raw bytes in, a `GenerateRequest` (what the routes run) or an `ApiError`
naming the offending field out. The field types and ranges live in `schema.py` (pydantic).

The daemon and the router parse alike with this module, so the router predicts exactly the prompt a daemon
will run. How to sample is returned as a plain `Sampling` value: the daemon turns it into its engine's
parameters (daemon/server/prepare.py); nothing here knows the engine."""

from __future__ import annotations

import json
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar, get_args

from pydantic import BaseModel, ValidationError

from kvpilot.kv.reset_scope import RESET_SCOPE_FIELDS, TENANT_NAME, ResetScope
from kvpilot.protocol import JSONObject
from kvpilot.protocol.errors import ApiError, bad
from kvpilot.protocol.fields import ignored_fields
from kvpilot.protocol.limits import MAX_SCOPE_CHARS
from kvpilot.protocol.schema import (
    ChatCompletionRequest,
    ChatMessage,
    ChatPromptRequest,
    CompletionPromptRequest,
    CompletionRequest,
)

M = TypeVar("M", bound=BaseModel)


@dataclass(frozen=True, slots=True)
class Sampling:
    """How the client asked to sample, OpenAI's defaults filled in, in the engine's terms."""

    max_tokens: int  # without max_tokens given: OpenAI's legacy 16 (the daemon fits it to the context)
    temperature: float
    top_p: float
    top_k: int  # 0: off
    min_p: float
    repetition_penalty: float
    min_tokens: int
    seed: int | None
    stop_token_ids: frozenset[int]
    ignore_eos: bool
    n: int  # sequences run per prompt: best_of when larger than the choices returned
    logprobs: int | None
    prompt_logprobs: int | None


@dataclass(slots=True)
class GenerateRequest:
    """What both endpoints reduce to: prompts (text or token ids) and how to sample and report them."""

    model: str
    prompts: list[str | list[int]]
    params: Sampling
    lora_name: str | None = None  # `model` names this LoRA adapter (None: the base model)
    stop: list[str] = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False
    cache_salt: str | None = None
    weight_version: str | None = None  # the weights the request must run on
    pin_prefix: bool = False  # pin the prompt's full blocks once it is computed
    pin_refused: str | None = None  # why the server did not pass pin_prefix on (the reply's reason)
    kv_transfer_params: dict[str, Any] | None = None  # P/D disaggregation, as sent (daemon/server/disagg.py)
    max_tokens_given: bool = False
    max_tokens_param: str = "max_tokens"  # the field the client used, for error messages
    n: int = 1  # choices per prompt
    echo: bool = False  # completions: the prompt (and its logprobs) before the completion
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    ignored_fields: list[str] = field(default_factory=list)  # unknown fields, cleaned (fields.py)


@dataclass(slots=True)
class ChatPrompt:
    """What a chat's prompt is made of: its messages, plain, and how the chat template is to render them."""

    messages: list[dict[str, str]]
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    tools: list[Any] | None = None  # as the schema takes them: JSON handed to the chat template

    def render(self, tokenizer: Any) -> str:
        """The prompt text, by the model's chat template (the daemon and the router's prediction alike)."""
        text: str = tokenizer.apply_chat_template(  # tokenize=False: the rendered text
            self.messages,
            tools=self.tools or None,
            tokenize=False,
            add_generation_prompt=self.add_generation_prompt,
            continue_final_message=self.continue_final_message,
        )
        return text


@dataclass(slots=True)
class ChatRequest:
    generate: GenerateRequest
    prompt: ChatPrompt


# ---- body ----------------------------------------------------------------------------------------
def parse_json_object(raw: bytes) -> JSONObject:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise bad(f"the request body is not valid UTF-8 (byte {exc.start})") from None
    if not text.strip():
        raise bad("the request body is empty; expected a JSON object")
    try:
        body = json.loads(text, parse_constant=_reject_constant)
    except json.JSONDecodeError as exc:
        raise bad(
            f"the request body is not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}"
        ) from None
    except ValueError as exc:
        raise bad(str(exc)) from None
    except RecursionError:
        raise bad("the request body is nested too deeply") from None
    if not isinstance(body, dict):
        raise bad(f"the request body must be a JSON object, not {_kind(body)}")
    _reject_lone_surrogates(body)
    return body


def _reject_lone_surrogates(body: JSONObject) -> None:
    """JSON may escape half a UTF-16 pair (`"\\ud800"`); such a string cannot be encoded, and would
    fail deep inside the tokenizer or the engine's block hashing. Refuse it here, with its field."""
    stack: list[tuple[str, Any]] = [(k, v) for k, v in body.items()]
    while stack:
        path, value = stack.pop()
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                raise bad(
                    f"'{path}' holds an unpaired UTF-16 surrogate, which is not valid Unicode",
                    path.split("[")[0].split(".")[0],
                ) from None
        elif isinstance(value, dict):
            stack.extend((f"{path}.{k}", v) for k, v in value.items())
        elif isinstance(value, list):
            stack.extend((f"{path}[{i}]", v) for i, v in enumerate(value))


def _reject_constant(name: str) -> Any:
    raise ValueError(f"the request body is not valid JSON: {name} is not a JSON number")


def _kind(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    return "an object"


def _validate(model: type[M], body: JSONObject) -> M:
    """The pydantic model of `body`; its first error as a 400 naming the field (`messages[0].role`)."""
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        err = exc.errors(include_url=False)[0]
        param = ""
        for part in err["loc"]:
            param += f"[{part}]" if isinstance(part, int) else f".{part}" if param else str(part)
        message = err["msg"].removeprefix("Value error, ")
        raise bad(f"'{param}': {message}" if param else message, param or None) from None


def _resolve_model(name: str | None, served: list[str], adapters: Collection[str]) -> str:
    """The model a request runs on: one of the served names is the base model (reported by its first
    name, as vLLM does), an adapter's name is that adapter."""
    if name is not None and name in adapters:
        return name
    if name is not None and name not in served:
        raise ApiError(
            404,
            f"The model '{name}' does not exist; this server serves '{served[0]}'",
            "model",
            code="model_not_found",
        )
    return served[0]


def _sampling(
    r: CompletionRequest | ChatCompletionRequest,
    max_tokens: int | None,
    n: int,
    logprobs: int | None,
    prompt_logprobs: int | None = None,
) -> Sampling:
    top_k = r.top_k or 0
    return Sampling(
        max_tokens=16 if max_tokens is None else max_tokens,  # OpenAI's legacy default; chat: the room left
        temperature=1.0 if r.temperature is None else r.temperature,  # OpenAI's default: sampled
        top_p=r.top_p or 1.0,
        top_k=0 if top_k == -1 else top_k,
        min_p=r.min_p or 0.0,
        repetition_penalty=r.repetition_penalty or 1.0,
        min_tokens=r.min_tokens or 0,
        seed=r.seed,
        stop_token_ids=frozenset(r.stop_token_ids or ()),
        ignore_eos=bool(r.ignore_eos),
        n=n,
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
    )


def _generate_request(
    r: CompletionRequest | ChatCompletionRequest,
    served: list[str],
    adapters: Collection[str],
    params: Sampling,
    **fields: Any,
) -> GenerateRequest:
    return GenerateRequest(
        model=_resolve_model(r.model, served, adapters),
        lora_name=r.model if r.model is not None and r.model in adapters else None,
        params=params,
        stop=r.stop or [],
        stream=bool(r.stream),
        include_usage=bool(r.stream_options and r.stream_options.include_usage),
        cache_salt=r.cache_salt,
        weight_version=r.weight_version,
        pin_prefix=bool(r.pin_prefix),
        kv_transfer_params=r.kv_transfer_params,
        n=r.n or 1,
        skip_special_tokens=r.skip_special_tokens is not False,
        include_stop_str_in_output=bool(r.include_stop_str_in_output or r.no_stop_trim),
        ignored_fields=ignored_fields(r.model_extra or {}),
        **fields,
    )


# ---- endpoints -----------------------------------------------------------------------------------
def parse_completion(body: JSONObject, served: list[str], adapters: Collection[str] = ()) -> GenerateRequest:
    r: CompletionRequest = _validate(CompletionRequest, body)
    prompt_logprobs = (r.logprobs or 0) if r.scores_prompt() else None
    params = _sampling(r, r.max_tokens, r.best_of or r.n or 1, r.logprobs, prompt_logprobs)
    return _generate_request(
        r,
        served,
        adapters,
        params,
        prompts=r.prompt,
        max_tokens_given=r.max_tokens is not None,
        echo=bool(r.echo),
    )


def completion_prompts(body: JSONObject) -> tuple[list[str | list[int]], str | None] | None:
    """A completion's prompts and its `cache_salt`, read as `parse_completion` reads them, and nothing else
    of the body (the router's read, as `chat_prompt`); None where the prompt's logprobs are asked for:
    every position of the prompt is then computed, cached or not."""
    r: CompletionPromptRequest = _validate(CompletionPromptRequest, body)
    return None if r.scores_prompt() else (r.prompt, r.cache_salt)


def parse_chat(body: JSONObject, served: list[str], adapters: Collection[str] = ()) -> ChatRequest:
    r: ChatCompletionRequest = _validate(ChatCompletionRequest, body)
    max_tokens = r.max_completion_tokens if r.max_completion_tokens is not None else r.max_tokens
    params = _sampling(r, max_tokens, r.n or 1, (r.top_logprobs or 0) if r.logprobs else None)
    req = _generate_request(
        r,
        served,
        adapters,
        params,
        prompts=[],  # rendered by the server with the model's chat template
        max_tokens_given=max_tokens is not None,
        max_tokens_param="max_completion_tokens" if r.max_completion_tokens is not None else "max_tokens",
    )
    return ChatRequest(req, _chat_prompt(r))


def chat_prompt(body: JSONObject) -> tuple[ChatPrompt, str | None]:
    """A chat's prompt and its `cache_salt`, read as `parse_chat` reads them, in a third of the time:
    nothing else of the body is checked or read, so a body `parse_chat` refuses may pass. The router keys
    prompts with it (the pod checks the rest). `body` is decoded JSON (its keys are strings)."""
    messages = body.get("messages") if type(body) is dict else None
    if (
        type(messages) is list
        and messages
        and _PROMPT_OPTIONS.isdisjoint(body)
        and all(map(_plain_message, messages))
    ):
        # What ChatPromptRequest makes of plain messages and no other prompt field, read without it:
        # pydantic's two validators per message were two thirds of a short chat's read (3.5 of 5 us).
        # tests/router/test_prompt_reads.py holds both reads equal.
        return ChatPrompt([_message(m["role"], m["content"]) for m in messages]), None
    r: ChatPromptRequest = _validate(ChatPromptRequest, body)
    return _chat_prompt(r), r.cache_salt


# A chat body's fields besides its messages that its prompt is made of: a body naming one is read whole.
_PROMPT_OPTIONS = frozenset(ChatPromptRequest.model_fields) - {"messages"}
_ROLES = frozenset(get_args(ChatMessage.model_fields["role"].annotation))


def _plain_message(message: Any) -> bool:
    """A message ChatMessage takes as it is: a role it names and text content (other keys are ignored)."""
    if type(message) is not dict:
        return False
    role = message.get("role")
    return type(role) is str and role in _ROLES and type(message.get("content")) is str


def _chat_prompt(r: ChatCompletionRequest | ChatPromptRequest) -> ChatPrompt:
    messages = [_message(m.role, m.content) for m in r.messages]
    # vLLM's rule: continuing the last message means no new assistant turn is opened.
    cont = bool(r.continue_final_message)
    return ChatPrompt(messages, r.add_generation_prompt is not False and not cont, cont, r.tools)


def _message(role: str, content: str) -> dict[str, str]:
    """A message as the chat template is given it: OpenAI's developer role is the template's system role."""
    return {"role": "system" if role == "developer" else role, "content": content}


def parse_reset_flag(
    name: str, query_value: str | None, body: JSONObject | None, default: bool = False
) -> bool:
    """A boolean of POST /reset_prefix_cache (`reset_running_requests`, `reset_external`; the router's
    `verify` too) from the query string (vLLM's way) or a JSON body."""
    if query_value is not None:
        lowered = query_value.strip().lower()
        if lowered in ("true", "1", "yes"):
            return True
        if lowered in ("false", "0", "no", ""):
            return False
        raise bad(f"'{name}' must be true or false", name)
    value = (body or {}).get(name)
    if value is not None and not isinstance(value, bool):
        raise bad(f"'{name}' must be a boolean, not {_kind(value)}", name)
    return default if value is None else value


def parse_reset_scope(query: Mapping[str, str], body: JSONObject | None) -> ResetScope | None:
    """The scope of POST /reset_prefix_cache, from the query string or a JSON body; None: everything."""
    given = {}
    for name in RESET_SCOPE_FIELDS:
        value = query.get(name)
        if value is None:
            value = (body or {}).get(name)
        if value is None:
            continue
        if not isinstance(value, str) or not 1 <= len(value) <= MAX_SCOPE_CHARS:
            raise bad(f"'{name}' must be a string of 1 to {MAX_SCOPE_CHARS} characters", name)
        if name == "tenant" and not TENANT_NAME.fullmatch(value):
            raise bad("'tenant' is a tenant's name: 1 to 63 letters, digits, '.', '_' or '-'", name)
        given[name] = value
    if "tenant" in given and "cache_salt" in given:
        # a tenant's partition is keyed tenant:<name>:<salt>, never the bare salt: name it so in cache_salt
        raise bad("give 'tenant' or 'cache_salt', not both ('cache_salt': 'tenant:<name>:<salt>')", "tenant")
    return ResetScope(**given) if given else None
