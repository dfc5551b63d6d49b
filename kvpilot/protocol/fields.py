"""Request fields the schema does not model, treated as vLLM treats them: a field that asks for nothing
is accepted, a field asking for what this server cannot give is a 400 naming it, and any other field is
ignored, logged once per name and listed in the reply's `X-Kvpilot-Ignored-Fields` header.

Gateways, SDKs (`extra_body`) and routers (SGLang's re-sends every chat with its own defaults) add
fields of their own; refusing every unknown one would fail them all.
"""

from __future__ import annotations

import logging
import re
from typing import Any

from kvpilot.protocol.errors import bad

log = logging.getLogger(__name__)

IGNORED_FIELDS_HEADER = "X-Kvpilot-Ignored-Fields"

# Accepted with any value: they change nothing about the reply's text.
NO_EFFECT = frozenset({"user", "metadata", "store", "service_tier", "parallel_tool_calls"})

# Constrained decoding, under vLLM's and SGLang's names.
_CONSTRAINED = (
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
    "structured_outputs",
    "regex",
    "ebnf",
    "json_schema",
)
# Features this server lacks: a value that asks for nothing (null, false, 0, "", [], {}) is accepted,
# anything else is refused with the reason.
UNSUPPORTED = {
    "return_hidden_states": "'return_hidden_states' is not supported: this server returns no hidden states",
    "use_beam_search": "beam search is not supported",
    "prompt_logprobs": "'prompt_logprobs' is not supported; completions return them with echo and logprobs",
    "truncate_prompt_tokens": "'truncate_prompt_tokens' is not supported",
    "chat_template": "a request's own 'chat_template' is not supported; the model's template is used",
    "chat_template_kwargs": "'chat_template_kwargs' is not supported",
    "logits_processors": "'logits_processors' is not supported",
    "bad_words": "'bad_words' is not supported",
    "allowed_token_ids": "'allowed_token_ids' is not supported",
    "lora_path": "LoRA adapters are not supported",
    "return_tokens_as_token_ids": "'return_tokens_as_token_ids' is not supported",
    **{name: f"constrained decoding ('{name}') is not supported" for name in _CONSTRAINED},
}
_ASKS_NOTHING: tuple[object, ...] = (None, False, 0, "", [], {})

# Names are client input: bounded and reduced to a safe alphabet before they reach a log or a header.
MAX_NAMES = 16
MAX_NAME_CHARS = 64
MAX_HEADER_CHARS = 512
MAX_LOGGED_NAMES = 256  # distinct names logged per process; later ones are not
_UNSAFE = re.compile(r"[^A-Za-z0-9_.\-]")


def ignored_fields(extra: dict[str, Any]) -> list[str]:
    """The names of `extra` (fields the schema does not model) this server ignores, cleaned and capped;
    a 400 for the first one that asks for a feature this server lacks."""
    ignored: list[str] = []
    for name, value in extra.items():
        if name in UNSUPPORTED:
            if _asks(name, value):
                raise bad(UNSUPPORTED[name], name)
        elif name not in NO_EFFECT and len(ignored) < MAX_NAMES:
            ignored.append(_clean(name))
    return list(dict.fromkeys(ignored))


def _asks(name: str, value: Any) -> bool:
    return value not in _ASKS_NOTHING


def _clean(name: str) -> str:
    short = _UNSAFE.sub("?", name[:MAX_NAME_CHARS])
    return short + ("..." if len(name) > MAX_NAME_CHARS else "")


def ignored_fields_headers(names: list[str]) -> dict[str, str]:
    """The reply's header naming the fields it ignored, for the client to see; none when it ignored none."""
    return {IGNORED_FIELDS_HEADER: header_value(names)} if names else {}


def header_value(names: list[str]) -> str:
    """`a,b,c`, cut at whole names to at most MAX_HEADER_CHARS."""
    out = ""
    for name in names:
        joined = f"{out},{name}" if out else name
        if len(joined) > MAX_HEADER_CHARS:
            break
        out = joined
    return out


class IgnoredFieldLog:
    """One log line per ignored field name per process (at most MAX_LOGGED_NAMES names)."""

    def __init__(self) -> None:
        self._seen: set[str] = set()

    def note(self, names: list[str], route: str) -> None:
        for name in names:
            if name in self._seen or len(self._seen) >= MAX_LOGGED_NAMES:
                continue
            self._seen.add(name)
            log.info("ignoring request field '%s' (first seen on %s; not logged again)", name, route)
