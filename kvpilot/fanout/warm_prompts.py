"""A warm-up's prompts as people write them: a JSON or YAML list of items, each a chat (`messages`: role and
content) or a plain `prompt`, bounded and checked here for every reader of them: a PrefixCacheWarmup's
ConfigMap and inline prompts (operator/warmups/prompts.py), `kvpilot bench --warm FILE` (kvpilot/cli). The
bounds are the CRD's for inline prompts (tests/operator/test_operator_warmup_parts.py reads both). A bad list
is refused with a message that names the item and what is wrong with it.
"""

from __future__ import annotations

from typing import Any

import yaml

from kvpilot.fanout.warmup import WarmPrompt

MAX_PROMPTS = 64
MAX_MESSAGES = 64  # messages in one chat prompt
MAX_PROMPT_CHARS = 65536  # characters of a prompt text or of one message's content
MAX_PROMPTS_BYTES = 256 << 10  # bytes of a ConfigMap key's value or a file read as prompts
ROLES = ("system", "user", "assistant")


class _NoAliases(yaml.SafeLoader):  # type: ignore[misc]  # yaml is untyped here (pyproject.toml)
    """YAML without aliases (`*name`): a few bytes of aliases can stand for an exponential tree, which a
    walk over the prompts would pay for; prompts never need them."""

    def compose_node(self, parent: Any, index: Any) -> Any:
        if self.check_event(yaml.events.AliasEvent):
            raise yaml.YAMLError("YAML aliases (*name) are not accepted in prompts")
        return super().compose_node(parent, index)


def parse(text: str) -> tuple[WarmPrompt, ...]:
    """A JSON or YAML list of prompt items. ValueError with a message for people when it is not one (its
    size, its syntax, the first bad item)."""
    size = len(text.encode())
    if size > MAX_PROMPTS_BYTES:
        raise ValueError(f"{size} bytes: prompts are read from at most {MAX_PROMPTS_BYTES} bytes")
    try:
        raw = yaml.load(text, Loader=_NoAliases)  # noqa: S506 - a SafeLoader (JSON is YAML too)
    except yaml.YAMLError as exc:
        raise ValueError(f"neither JSON nor YAML: {' '.join(str(exc).split())[:200]}") from None
    if not isinstance(raw, list):
        raise ValueError(f"a list of prompts is needed, not {type(raw).__name__}")
    return from_items(raw)


def from_items(items: list[Any]) -> tuple[WarmPrompt, ...]:
    """Decoded items (dicts with `messages` or `prompt`) as prompts; ValueError naming the first bad one."""
    if not 0 < len(items) <= MAX_PROMPTS:
        raise ValueError(f"between 1 and {MAX_PROMPTS} prompts are needed, not {len(items)}")
    return tuple(_prompt(item, i) for i, item in enumerate(items))


def _prompt(item: Any, i: int) -> WarmPrompt:
    if not isinstance(item, dict) or set(item) - {"messages", "prompt"}:
        raise ValueError(f"prompt {i}: an object with messages (a chat) or prompt (a text) is needed")
    messages, prompt = item.get("messages"), item.get("prompt")
    if (messages is None) == (prompt is None):
        raise ValueError(f"prompt {i}: exactly one of messages and prompt must be set")
    if prompt is not None:
        if not isinstance(prompt, str) or not 0 < len(prompt) <= MAX_PROMPT_CHARS:
            raise ValueError(f"prompt {i}: prompt must have 1 to {MAX_PROMPT_CHARS} characters")
        return WarmPrompt(text=prompt)
    if not isinstance(messages, list) or not 0 < len(messages) <= MAX_MESSAGES:
        raise ValueError(f"prompt {i}: messages must hold 1 to {MAX_MESSAGES} messages")
    chat = []
    for j, m in enumerate(messages):
        where = f"prompt {i}: messages.{j}"
        if not isinstance(m, dict) or set(m) - {"role", "content"}:
            raise ValueError(f"{where}: an object with role and content is needed")
        role, content = m.get("role"), m.get("content")
        if role not in ROLES:
            raise ValueError(f"{where}.role must be one of {', '.join(ROLES)}")
        if not isinstance(content, str):
            raise ValueError(f"{where}.content must be a string")
        if len(content) > MAX_PROMPT_CHARS:
            raise ValueError(f"{where}.content is longer than {MAX_PROMPT_CHARS} characters")
        chat.append((role, content))
    return WarmPrompt(messages=tuple(chat))
