"""The OpenAI request bodies as pydantic models: types, ranges and the OpenAPI schema in one place.

Fields are strict (a boolean is not an integer, a string is not a number) and may be null (meaning the
default). Checks that span fields, and fields asking for what this server does not implement, raise
`ApiError` naming the field, so the client sees which one was wrong. Fields not modelled here are sorted
by `fields.py` (accepted, refused or ignored).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, Strict, field_validator, model_validator

from kvpilot.protocol import JSONObject
from kvpilot.protocol.errors import ApiError, bad
from kvpilot.protocol.limits import MAX_LOGPROBS, MAX_SCOPE_CHARS, MAX_SEQUENCES, MAX_STOP_TOKEN_IDS

Int = Annotated[int, Strict()]
Bool = Annotated[bool, Strict()]
Str = Annotated[str, Strict()]
Float = Annotated[float, Strict()]  # ints are numbers too; strings and booleans are not
TokenId = Annotated[int, Strict(), Field(ge=0)]

MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 1024
MAX_PROMPTS = 64
NO_REASONING_PARSER = "SGLang: accepted; no effect, this server has no reasoning parser"


CacheSalt = Annotated[
    Str | None,
    Field(min_length=1, max_length=MAX_SCOPE_CHARS, description="requests with different salts share no KV"),
]


class StreamOptions(BaseModel):
    include_usage: Bool | None = Field(None, description="a last chunk with empty choices and the usage")


class _Request(BaseModel):
    """Fields both endpoints share."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    model: Str | None = Field(None, description="a served model name; default: the first")
    temperature: Float | None = Field(None, ge=0, le=100, description="default 1; below 1e-5: greedy")
    top_p: Float | None = Field(None, gt=0, le=1)
    top_k: Int | None = Field(None, ge=-1, description="-1 or 0: off")
    min_p: Float | None = Field(None, ge=0, le=1, description="vLLM: drop tokens below min_p x the top one")
    repetition_penalty: Float | None = Field(None, gt=0, le=100, description="vLLM: > 1 discourages repeats")
    presence_penalty: Float | None = Field(None, ge=-2, le=2, description="only 0 is supported")
    frequency_penalty: Float | None = Field(None, ge=-2, le=2, description="only 0 is supported")
    logit_bias: dict[str, Any] | None = Field(None, description="not supported")
    n: Int | None = Field(None, ge=1, le=MAX_SEQUENCES, description="choices per prompt, sharing its KV")
    seed: Int | None = Field(None, ge=-(2**63), le=2**64 - 1, description="choice i uses seed + i")
    stop: Any = Field(None, description=f"a string or up to {MAX_STOP_STRINGS} strings")
    stop_token_ids: list[TokenId] | None = Field(None, max_length=MAX_STOP_TOKEN_IDS)
    ignore_eos: Bool | None = None
    min_tokens: Int | None = Field(None, ge=0, description="vLLM: EOS and stop ids cannot end earlier")
    skip_special_tokens: Bool | None = None
    include_stop_str_in_output: Bool | None = None
    no_stop_trim: Bool | None = Field(None, description="SGLang: include_stop_str_in_output under its name")
    cache_salt: CacheSalt = None
    weight_version: Str | None = Field(
        None,
        min_length=1,
        max_length=MAX_SCOPE_CHARS,
        description="run only on these weights (409 weight_version_mismatch otherwise)",
    )
    pin_prefix: Bool | None = Field(
        None,
        description="keep the prompt's full blocks cached, never evicted, until unpinned or reset "
        "(--enable-pinned-prefix); the reply's pin_prefix says whether they were",
    )
    kv_transfer_params: dict[str, Any] | None = Field(
        None,
        description="vLLM's prefill/decode disaggregation: do_remote_decode (hold the prompt's KV for a "
        "decode pod; the reply's kv_transfer_params say where) or do_remote_prefill (pull it from there); "
        "needs --kv-transfer-config",
    )
    stream: Bool | None = None
    stream_options: StreamOptions | None = None

    @field_validator("stop", mode="before")
    @classmethod
    def _stop(cls, value: Any) -> list[str]:
        if value is None:
            return []
        items = [value] if isinstance(value, str) else value
        if not isinstance(items, list) or not all(isinstance(s, str) for s in items):
            raise bad("'stop' must be a string or an array of strings", "stop")
        if len(items) > MAX_STOP_STRINGS:
            raise bad(f"'stop' may hold at most {MAX_STOP_STRINGS} strings", "stop")
        if any(not s or len(s) > MAX_STOP_STRING_CHARS for s in items):
            raise bad(f"each stop string must have 1 to {MAX_STOP_STRING_CHARS} characters", "stop")
        return list(dict.fromkeys(items))

    @model_validator(mode="after")
    def _shared_checks(self) -> _Request:
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name):
                raise bad(f"'{name}' is not supported; leave it at 0 (repetition_penalty is)", name)
        if self.logit_bias:
            raise bad("'logit_bias' is not supported", "logit_bias")
        if self.stream_options is not None and not self.stream:
            raise bad("'stream_options' is only allowed when 'stream' is true", "stream_options")
        return self


class _CompletionPrompt(BaseModel):
    """The fields of a completion request that say what its prompts are and whether their logprobs are
    scored (so every position is computed, cached or not)."""

    prompt: Any = Field(
        description="a string, an array of strings, an array of token ids or an array of arrays of token ids"
    )
    max_tokens: Int | None = Field(None, ge=0, description="default 16; 0 only with echo (scores the prompt)")
    echo: Bool | None = Field(None, description="return the prompt (and its logprobs) before the completion")
    logprobs: Int | Bool | None = Field(
        None, description=f"0-{MAX_LOGPROBS} most likely alternatives per token"
    )

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt(cls, value: Any) -> list[str | list[int]]:
        return _prompts(value)

    @field_validator("logprobs")
    @classmethod
    def _logprobs(cls, value: int | bool | None) -> int | None:
        if isinstance(value, bool):  # vLLM accepts a boolean here too
            return 0 if value else None
        if value is not None and not 0 <= value <= MAX_LOGPROBS:
            raise bad(f"'logprobs' must be between 0 and {MAX_LOGPROBS}", "logprobs")
        return value

    def scores_prompt(self) -> bool:
        """Whether the prompt's own logprobs are asked for (echo with logprobs, or echo alone scoring it)."""
        return bool(self.echo) and (self.logprobs is not None or self.max_tokens == 0)


class CompletionPromptRequest(_CompletionPrompt):
    """What the router reads of a completion to key its prompts, as CompletionRequest reads it (the pod
    checks the rest)."""

    model_config = ConfigDict(extra="ignore")

    cache_salt: CacheSalt = None


class CompletionRequest(_CompletionPrompt, _Request):  # (this order keeps _Request's fields first)
    best_of: Int | None = Field(
        None, ge=1, le=MAX_SEQUENCES, description="sequences run; the n most likely return"
    )
    suffix: Str | None = Field(None, description="not supported")

    @model_validator(mode="after")
    def _checks(self) -> CompletionRequest:
        if self.max_tokens == 0 and not self.echo:
            raise bad("'max_tokens' must be at least 1 (0 only with echo, to score the prompt)", "max_tokens")
        if self.min_tokens and self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad("'min_tokens' must not exceed max_tokens", "min_tokens")
        n = self.n or 1
        if self.best_of is not None and self.best_of < n:
            raise bad("'best_of' must be at least n", "best_of")
        if (self.best_of or n) > n and self.stream:
            raise bad("'best_of' greater than n cannot be streamed", "best_of")
        if self.suffix:
            raise bad("'suffix' is not supported", "suffix")
        return self


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")  # name, tool_call_id, ...: not used by chat templates here

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Any = Field(None, description="a string or an array of text parts")

    @field_validator("content", mode="before")
    @classmethod
    def _content(cls, value: Any) -> Any:
        if value is None or isinstance(value, str):
            return value
        if isinstance(value, list):
            parts = []
            for part in value:
                if (
                    not isinstance(part, dict)
                    or part.get("type") != "text"
                    or not isinstance(part.get("text"), str)
                ):
                    raise ValueError(
                        'content parts must be text parts {"type": "text", "text": ...}; '
                        "other content types are not supported"
                    )
                parts.append(part["text"])
            return "\n".join(parts)
        raise ValueError("content must be a string or an array of text parts")

    @model_validator(mode="after")
    def _present(self) -> ChatMessage:
        if self.content is None:
            if self.role != "assistant":
                raise ValueError("content is required")
            self.content = ""
        return self


# The fields that make a chat's prompt, in both models below.
ChatMessages = Annotated[list[ChatMessage], Field(min_length=1)]
ContinueFinalMessage = Annotated[
    Bool | None, Field(description="vLLM: the last (assistant) message is left open and continued")
]
Tools = Annotated[list[Any] | None, Field(description="rendered by the chat template; replies are text")]


class ChatPromptRequest(BaseModel):
    """The fields of a chat request its prompt is made of, read as ChatCompletionRequest reads them and
    nothing else: what the router reads of a chat to key its prompt (the pod checks the rest)."""

    model_config = ConfigDict(extra="ignore")

    messages: ChatMessages
    add_generation_prompt: Bool | None = None
    continue_final_message: ContinueFinalMessage = None
    tools: Tools = None
    cache_salt: CacheSalt = None


class ChatCompletionRequest(_Request):
    messages: ChatMessages
    max_completion_tokens: Int | None = Field(None, ge=1, description="default: the room left in the context")
    max_tokens: Int | None = Field(None, ge=1, description="the older name of max_completion_tokens")
    logprobs: Bool | None = None
    top_logprobs: Int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: Bool | None = None
    continue_final_message: ContinueFinalMessage = None
    tools: Tools = None
    tool_choice: Any = Field(None, description='"none" or "auto"; a forced call is not supported')
    separate_reasoning: Bool | None = Field(None, description=NO_REASONING_PARSER)
    stream_reasoning: Bool | None = Field(None, description=NO_REASONING_PARSER)
    include_reasoning: Bool | None = Field(
        None,
        description="vLLM (vllm-router sends it): accepted; no effect, this server has no reasoning parser",
    )
    response_format: dict[str, Any] | None = Field(None, description='only {"type": "text"}')

    @model_validator(mode="after")
    def _checks(self) -> ChatCompletionRequest:
        limit = self.max_completion_tokens or self.max_tokens
        if self.min_tokens and limit is not None and self.min_tokens > limit:
            raise bad("'min_tokens' must not exceed max_completion_tokens", "min_tokens")
        if self.top_logprobs is not None and not self.logprobs:
            raise bad("'top_logprobs' needs 'logprobs': true", "top_logprobs")
        if self.tool_choice not in (None, "none", "auto"):
            forced = 'forcing a tool call is not supported; tool_choice may be "none" or "auto"'
            raise bad(forced, "tool_choice")
        if self.continue_final_message and self.add_generation_prompt:
            both = "'continue_final_message' and 'add_generation_prompt' cannot both be true"
            raise bad(both, "continue_final_message")
        if self.response_format is not None and self.response_format.get("type") != "text":
            raise bad('only response_format {"type": "text"} is supported', "response_format")
        return self


def _prompts(value: Any) -> list[str | list[int]]:
    def ids(v: Any) -> bool:
        return (
            isinstance(v, list) and bool(v) and all(isinstance(t, int) and not isinstance(t, bool) for t in v)
        )

    if isinstance(value, str):
        prompts: list[str | list[int]] = [value]
    elif ids(value):
        prompts = [list(value)]
    elif isinstance(value, list) and value and all(isinstance(p, str) for p in value):
        prompts = list(value)
    elif isinstance(value, list) and value and all(ids(p) for p in value):
        prompts = [list(p) for p in value]
    else:
        raise bad(
            "'prompt' must be a string, an array of strings, an array of token ids or an array of "
            "arrays of token ids, and must not be empty",
            "prompt",
        )
    if len(prompts) > MAX_PROMPTS:
        raise bad(f"at most {MAX_PROMPTS} prompts per request", "prompt")
    if any(isinstance(p, str) and not p for p in prompts):
        raise bad("'prompt' must not be an empty string", "prompt")
    if any(t < 0 for p in prompts if isinstance(p, list) for t in p):
        raise bad("'prompt' token ids must be non-negative", "prompt")
    return prompts


def openapi(version: str) -> JSONObject:
    """A small OpenAPI 3.1 document of the generation routes, from the models above."""
    schemas: JSONObject = {}
    refs = {}
    for model in (CompletionRequest, ChatCompletionRequest):
        schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
        schemas.update(schema.pop("$defs", {}))
        schemas[model.__name__] = schema
        refs[model.__name__] = {"$ref": f"#/components/schemas/{model.__name__}"}

    def route(summary: str, model: str) -> JSONObject:
        return {
            "post": {
                "summary": summary,
                "requestBody": {"required": True, "content": {"application/json": {"schema": refs[model]}}},
                "responses": {
                    "200": {"description": "OpenAI's response, or server-sent events with stream"},
                    "400": {"description": "OpenAI's error JSON naming the field"},
                },
            }
        }

    return {
        "openapi": "3.1.0",
        "info": {"title": "kvpilot daemon", "version": version},
        "paths": {
            "/v1/completions": route("Text completions", "CompletionRequest"),
            "/v1/chat/completions": route("Chat completions", "ChatCompletionRequest"),
        },
        "components": {"schemas": schemas},
    }


__all__ = ["ApiError", "ChatCompletionRequest", "CompletionRequest", "openapi"]
