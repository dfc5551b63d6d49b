"""OpenAI request validation: raw JSON in, typed requests or an `ApiError` with OpenAI's error shape out.

Every check names the offending `param`, so a client sees which field was wrong. A field this server
does not implement (unknown, or known but unimplemented such as `guided_json`) is refused by name when
it asks for a non-default behaviour, rather than silently ignored; the extras OpenAI clients send that
change nothing (`user`, `metadata`, ...) are accepted.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

from kvpilot.daemon.engine.request import MAX_LOGPROBS, MAX_SEQUENCES, MAX_STOP_TOKEN_IDS, SamplingParams

MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 1024
MAX_PROMPTS = 64


class ApiError(Exception):
    """An error to answer with `{"error": {"message", "type", "param", "code"}}`."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        type_: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.type = type_ or _default_type(status)
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def _default_type(status: int) -> str:
    if status == 401:
        return "authentication_error"
    if status == 404:
        return "not_found_error"
    if status == 503:
        return "service_unavailable_error"
    if status >= 500:
        return "server_error"
    return "invalid_request_error"


def bad(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param, code=code)


RETRY_AFTER_SECONDS = 1


def unavailable(message: str, code: str) -> ApiError:
    """Overloaded for now: 503 with Retry-After, so clients back off and come back."""
    return ApiError(503, message, code=code, headers={"Retry-After": str(RETRY_AFTER_SECONDS)})


@dataclass(slots=True)
class GenerateRequest:
    """What both endpoints reduce to: prompts (text or token ids) and how to sample and report them."""

    model: str
    prompts: list[str | list[int]]
    params: SamplingParams
    stop: list[str] = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False
    cache_salt: str | None = None
    max_tokens_given: bool = False
    max_tokens_param: str = "max_tokens"  # the field the client used, for error messages
    n: int = 1  # choices per prompt
    echo: bool = False  # completions: the prompt (and its logprobs) before the completion
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False


# ---- body ----------------------------------------------------------------------------------------
def parse_json_object(raw: bytes) -> dict:
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


def _reject_lone_surrogates(body: dict) -> None:
    """JSON may escape half a UTF-16 pair (`"\\ud800"`); such a string cannot be encoded, and would
    fail deep inside the tokenizer or the engine's block hashing. Refuse it here, with its field."""
    stack: list[tuple[str, Any]] = [(k, v) for k, v in body.items()]
    while stack:
        path, value = stack.pop()
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                raise bad(f"'{path}' holds an unpaired UTF-16 surrogate, which is not valid Unicode",
                          path.split("[")[0].split(".")[0]) from None  # fmt: skip
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
    if isinstance(value, int):
        return "an integer"
    if isinstance(value, float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    return "an object"


# ---- typed field readers (bool is not an int here, whatever Python thinks) -------------------------
def get_bool(body: dict, name: str, default: bool) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise bad(f"'{name}' must be a boolean, not {_kind(value)}", name)
    return value


def get_int(
    body: dict, name: str, default: int | None, lo: int | None = None, hi: int | None = None
) -> int | None:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad(f"'{name}' must be an integer, not {_kind(value)}", name)
    if lo is not None and value < lo:
        raise bad(f"'{name}' must be at least {lo}, got {value}", name)
    if hi is not None and value > hi:
        raise bad(f"'{name}' must be at most {hi}, got {value}", name)
    return value


def get_float(body: dict, name: str, default: float, lo: float, hi: float, lo_open: bool = False) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise bad(f"'{name}' must be a number, not {_kind(value)}", name)
    if value < lo or (lo_open and value == lo) or value > hi:
        interval = f"{'(' if lo_open else '['}{lo:g}, {hi:g}]"
        raise bad(f"'{name}' must be in {interval}, got {value}", name)
    return float(value)


def get_str(body: dict, name: str, default: str | None) -> str | None:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, str):
        raise bad(f"'{name}' must be a string, not {_kind(value)}", name)
    return value


# ---- shared fields -------------------------------------------------------------------------------
def resolve_model(body: dict, served: list[str]) -> str:
    model = get_str(body, "model", served[0])
    if model not in served:
        raise ApiError(404, f"The model '{model}' does not exist; this server serves '{served[0]}'", "model",
                       code="model_not_found")  # fmt: skip
    return served[0]


def _stop_strings(body: dict) -> list[str]:
    value = body.get("stop")
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


def _token_id_list(value: Any, name: str) -> list[int] | None:
    if isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        if any(t < 0 for t in value):
            raise bad(f"'{name}' token ids must be non-negative", name)
        return list(value)
    return None


# Fields OpenAI clients send that change nothing here.
IGNORED_FIELDS = frozenset(
    {"user", "metadata", "store", "service_tier", "parallel_tool_calls", "tool_choice"}
)
SHARED_FIELDS = frozenset({
    "model", "max_tokens", "temperature", "top_p", "top_k", "min_p", "n", "stream", "stream_options", "stop",
    "stop_token_ids", "seed", "logprobs", "presence_penalty", "frequency_penalty", "repetition_penalty",
    "logit_bias", "ignore_eos", "min_tokens", "skip_special_tokens", "include_stop_str_in_output",
    "cache_salt",
})  # fmt: skip
COMPLETION_FIELDS = SHARED_FIELDS | {"prompt", "best_of", "echo", "suffix"}
CHAT_FIELDS = SHARED_FIELDS | {
    "messages", "max_completion_tokens", "top_logprobs", "add_generation_prompt", "tools", "response_format",
}  # fmt: skip


def _refuse_unsupported(body: dict, chat: bool) -> None:
    """Refuse what this server does not do rather than silently ignore it: an unknown field with a
    non-default value, and known ones that ask for an unimplemented behaviour."""
    known = CHAT_FIELDS if chat else COMPLETION_FIELDS
    for name, value in body.items():
        if name not in known and name not in IGNORED_FIELDS and value not in (None, False, 0, "", [], {}):
            raise bad(f"'{name}' is not supported by this server", name)
    for name in ("presence_penalty", "frequency_penalty"):
        if get_float(body, name, 0.0, -2.0, 2.0) != 0.0:
            raise bad(f"'{name}' is not supported; leave it at 0 (repetition_penalty is)", name)
    if body.get("logit_bias"):
        raise bad("'logit_bias' is not supported", "logit_bias")
    if not chat:
        if get_str(body, "suffix", None):
            raise bad("'suffix' is not supported", "suffix")
    else:
        if body.get("tools"):
            raise bad("tool calling is not supported", "tools")
        fmt = body.get("response_format")
        if fmt is not None and (not isinstance(fmt, dict) or fmt.get("type") != "text"):
            raise bad('only response_format {"type": "text"} is supported', "response_format")


def _sampling(body: dict, max_tokens: int | None) -> SamplingParams:
    """Sampling fields shared by both endpoints; max_tokens, n and logprobs are set by the caller."""
    top_k = get_int(body, "top_k", 0, lo=-1)
    stop_ids = body.get("stop_token_ids")
    stop_token_ids: list[int] = []
    if stop_ids is not None:
        parsed = _token_id_list(stop_ids, "stop_token_ids")
        if parsed is None:
            raise bad("'stop_token_ids' must be an array of integers", "stop_token_ids")
        if len(parsed) > MAX_STOP_TOKEN_IDS:
            raise bad(f"'stop_token_ids' may hold at most {MAX_STOP_TOKEN_IDS} ids", "stop_token_ids")
        stop_token_ids = parsed
    params = SamplingParams(
        max_tokens=max_tokens if max_tokens is not None else 16,
        temperature=get_float(body, "temperature", 1.0, 0.0, 100.0),  # OpenAI's default: sampled
        top_p=get_float(body, "top_p", 1.0, 0.0, 1.0, lo_open=True),
        top_k=0 if top_k == -1 else top_k,
        min_p=get_float(body, "min_p", 0.0, 0.0, 1.0),
        repetition_penalty=get_float(body, "repetition_penalty", 1.0, 0.0, 100.0, lo_open=True),
        min_tokens=get_int(body, "min_tokens", 0, lo=0),
        seed=get_int(body, "seed", None, lo=-(2**63), hi=2**64 - 1),
        stop_token_ids=frozenset(stop_token_ids),
        ignore_eos=get_bool(body, "ignore_eos", False),
    )
    if max_tokens is not None and params.min_tokens > max_tokens:
        raise bad("'min_tokens' must not exceed max_tokens", "min_tokens")
    return params


def _stream_fields(body: dict) -> tuple[bool, bool]:
    stream = get_bool(body, "stream", False)
    opts = body.get("stream_options")
    if opts is None:
        return stream, False
    if not isinstance(opts, dict):
        raise bad("'stream_options' must be an object", "stream_options")
    if not stream:
        raise bad("'stream_options' is only allowed when 'stream' is true", "stream_options")
    return stream, get_bool(opts, "include_usage", False)


def _cache_salt(body: dict) -> str | None:
    salt = get_str(body, "cache_salt", None)
    if salt is not None and not salt:
        raise bad("'cache_salt' must be a non-empty string", "cache_salt")
    return salt


# ---- endpoints -----------------------------------------------------------------------------------
def parse_completion(body: dict, served: list[str]) -> GenerateRequest:
    model = resolve_model(body, served)
    _refuse_unsupported(body, chat=False)
    prompts = _prompts(body.get("prompt"))
    echo = get_bool(body, "echo", False)
    max_tokens = get_int(body, "max_tokens", None, lo=0)
    if max_tokens == 0 and not echo:
        raise bad("'max_tokens' must be at least 1 (0 only with echo, to score the prompt)", "max_tokens")
    stream, include_usage = _stream_fields(body)
    params = _sampling(body, max_tokens)  # default 16: OpenAI's legacy default
    n = get_int(body, "n", 1, lo=1, hi=MAX_SEQUENCES)
    best_of = get_int(body, "best_of", n, lo=1, hi=MAX_SEQUENCES)
    if best_of < n:
        raise bad("'best_of' must be at least n", "best_of")
    if best_of > n and stream:
        raise bad("'best_of' greater than n cannot be streamed", "best_of")
    params.n = best_of
    logprobs = body.get("logprobs")
    if isinstance(logprobs, bool):  # vLLM accepts a boolean here too
        logprobs = 0 if logprobs else None
    params.logprobs = get_int({"logprobs": logprobs}, "logprobs", None, lo=0, hi=MAX_LOGPROBS)
    if echo and (params.logprobs is not None or max_tokens == 0):
        params.prompt_logprobs = params.logprobs or 0
    return GenerateRequest(
        model=model,
        prompts=prompts,
        params=params,
        stop=_stop_strings(body),
        stream=stream,
        include_usage=include_usage,
        cache_salt=_cache_salt(body),
        max_tokens_given=max_tokens is not None,
        n=n,
        echo=echo,
        **_output_fields(body),
    )


def _output_fields(body: dict) -> dict:
    return {
        "skip_special_tokens": get_bool(body, "skip_special_tokens", True),
        "include_stop_str_in_output": get_bool(body, "include_stop_str_in_output", False),
    }


def _prompts(value: Any) -> list[str | list[int]]:
    if value is None:
        raise bad("'prompt' is required", "prompt")
    if isinstance(value, str):
        prompts: list[str | list[int]] = [value]
    elif (ids := _token_id_list(value, "prompt")) is not None and value:
        prompts = [ids]
    elif isinstance(value, list) and value and all(isinstance(p, str) for p in value):
        prompts = list(value)
    elif isinstance(value, list) and value and all(_token_id_list(p, "prompt") for p in value):
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
    return prompts


CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")


@dataclass(slots=True)
class ChatRequest:
    generate: GenerateRequest
    messages: list[dict[str, str]]
    add_generation_prompt: bool = True


def parse_chat(body: dict, served: list[str]) -> ChatRequest:
    model = resolve_model(body, served)
    _refuse_unsupported(body, chat=True)
    messages = _messages(body.get("messages"))
    max_tokens = get_int(body, "max_completion_tokens", None, lo=1)
    if max_tokens is None:
        max_tokens = get_int(body, "max_tokens", None, lo=1)
    stream, include_usage = _stream_fields(body)
    params = _sampling(body, max_tokens)  # without max_tokens: the room left in the context
    params.n = get_int(body, "n", 1, lo=1, hi=MAX_SEQUENCES)
    top = get_int(body, "top_logprobs", None, lo=0, hi=MAX_LOGPROBS)
    if get_bool(body, "logprobs", False):
        params.logprobs = top or 0
    elif top is not None:
        raise bad("'top_logprobs' needs 'logprobs': true", "top_logprobs")
    req = GenerateRequest(
        model=model,
        prompts=[],  # rendered by the server with the model's chat template
        params=params,
        n=params.n,
        **_output_fields(body),
        stop=_stop_strings(body),
        stream=stream,
        include_usage=include_usage,
        cache_salt=_cache_salt(body),
        max_tokens_given=max_tokens is not None,
        max_tokens_param="max_completion_tokens"
        if body.get("max_completion_tokens") is not None
        else "max_tokens",
    )
    return ChatRequest(req, messages, get_bool(body, "add_generation_prompt", True))


def _messages(value: Any) -> list[dict[str, str]]:
    if value is None:
        raise bad("'messages' is required", "messages")
    if not isinstance(value, list) or not value:
        raise bad("'messages' must be a non-empty array", "messages")
    out = []
    for i, msg in enumerate(value):
        where = f"messages[{i}]"
        if not isinstance(msg, dict):
            raise bad(f"'{where}' must be an object", where)
        role = msg.get("role")
        if role not in CHAT_ROLES:
            raise bad(f"'{where}.role' must be one of {', '.join(CHAT_ROLES)}", f"{where}.role")
        content = msg.get("content")
        if content is None and role == "assistant":
            content = ""
        out.append({"role": "system" if role == "developer" else role, "content": _content(content, where)})
    return out


def _content(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            if (
                not isinstance(part, dict)
                or part.get("type") != "text"
                or not isinstance(part.get("text"), str)
            ):
                raise bad(
                    f'\'{where}.content[{j}]\' must be a text part {{"type": "text", "text": ...}}; '
                    "other content types are not supported",
                    f"{where}.content",
                )
            parts.append(part["text"])
        return "\n".join(parts)
    raise bad(f"'{where}.content' must be a string or an array of text parts", f"{where}.content")


def parse_reset_flag(query_value: str | None, body: dict | None) -> bool:
    """`reset_running_requests` from the query string (vLLM's way) or a JSON body."""
    if query_value is not None:
        lowered = query_value.strip().lower()
        if lowered in ("true", "1", "yes"):
            return True
        if lowered in ("false", "0", "no", ""):
            return False
        raise bad("'reset_running_requests' must be true or false", "reset_running_requests")
    if body:
        return bool(get_bool(body, "reset_running_requests", False))
    return False
