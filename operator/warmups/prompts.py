"""A PrefixCacheWarmup's prompts: inline in its spec (bounded by the CRD's schema) or from a ConfigMap key
(`promptsFrom.configMapKeyRef`), a JSON or YAML list of the same items, bounded and checked here, since the
API server knows nothing of a ConfigMap's contents. A bad list fails the warm-up before any pod is called,
with reason InvalidPrompts and a message that names the item and what is wrong with it.

The ConfigMap's text goes to the targeted pods as prompts, never into a status (only counts and verdicts
do). Like any ConfigMap it is not a secret store: a user who may create a warm-up in a namespace can have
any ConfigMap there sent to pods it selects, as one who may create pods there could mount it.
"""

from __future__ import annotations

from typing import Any

import yaml
from pydantic import ValidationError

from kvpilot.fanout.warmup import WarmPrompt
from kvpilot.operator.kube.api import Kube
from kvpilot.operator.kube.retries import RunFailure, with_retries
from kvpilot.operator.specs import WarmupPrompt, WarmupSpec

# The CRD's bounds on inline prompts, the same here for a ConfigMap's (tests/operator/test_operator_warmup_parts.py
# reads both).
MAX_PROMPTS = 64
MAX_MESSAGES = 64  # messages in one chat prompt
MAX_PROMPT_CHARS = 65536  # characters of a prompt text or of one message's content
MAX_CONFIGMAP_BYTES = 256 << 10  # bytes of the ConfigMap key's value read as prompts
INVALID = "InvalidPrompts"
NOT_FOUND = "PromptsNotFound"


class _NoAliases(yaml.SafeLoader):  # type: ignore[misc]  # yaml is untyped here (pyproject.toml)
    """YAML without aliases (`*name`): a few bytes of aliases can stand for an exponential tree, which a
    walk over the prompts would pay for; prompts never need them."""

    def compose_node(self, parent: Any, index: Any) -> Any:
        if self.check_event(yaml.events.AliasEvent):
            raise yaml.YAMLError("YAML aliases (*name) are not accepted in prompts")
        return super().compose_node(parent, index)


def _prompt(item: WarmupPrompt, i: int) -> WarmPrompt:
    """One parsed item as the fan-out's prompt; ValueError naming the item when it breaks a bound."""
    if (item.messages is None) == (item.prompt is None):
        raise ValueError(f"prompt {i}: exactly one of messages and prompt must be set")
    if item.prompt is not None:
        if not 0 < len(item.prompt) <= MAX_PROMPT_CHARS:
            raise ValueError(f"prompt {i}: prompt must have 1 to {MAX_PROMPT_CHARS} characters")
        return WarmPrompt(text=item.prompt)
    assert item.messages is not None
    if not 0 < len(item.messages) <= MAX_MESSAGES:
        raise ValueError(f"prompt {i}: messages must hold 1 to {MAX_MESSAGES} messages")
    for j, m in enumerate(item.messages):
        if len(m.content) > MAX_PROMPT_CHARS:
            raise ValueError(f"prompt {i}: message {j} is longer than {MAX_PROMPT_CHARS} characters")
    return WarmPrompt(messages=tuple((m.role, m.content) for m in item.messages))


def inline(items: list[WarmupPrompt]) -> tuple[WarmPrompt, ...]:
    """spec.prompts, which the API server has checked against the same bounds."""
    if not 0 < len(items) <= MAX_PROMPTS:
        raise ValueError(f"between 1 and {MAX_PROMPTS} prompts are needed, not {len(items)}")
    return tuple(_prompt(item, i) for i, item in enumerate(items))


def parse(text: str) -> tuple[WarmPrompt, ...]:
    """A ConfigMap value as prompts: a JSON or YAML list of items as spec.prompts has them. ValueError with
    a message for people when it is not one (its size, its syntax, the first bad item)."""
    size = len(text.encode())
    if size > MAX_CONFIGMAP_BYTES:
        raise ValueError(f"{size} bytes: prompts are read from at most {MAX_CONFIGMAP_BYTES} bytes")
    try:
        raw = yaml.load(text, Loader=_NoAliases)  # noqa: S506 - a SafeLoader (JSON is YAML too)
    except yaml.YAMLError as exc:
        raise ValueError(f"neither JSON nor YAML: {' '.join(str(exc).split())[:200]}") from None
    if not isinstance(raw, list):
        raise ValueError(f"a list of prompts is needed, not {type(raw).__name__}")
    if not 0 < len(raw) <= MAX_PROMPTS:
        raise ValueError(f"between 1 and {MAX_PROMPTS} prompts are needed, not {len(raw)}")
    out = []
    for i, item in enumerate(raw):
        if not isinstance(item, dict) or set(item) - {"messages", "prompt"}:
            raise ValueError(f"prompt {i}: an object with messages (a chat) or prompt (a text) is needed")
        msgs = item.get("messages")
        if isinstance(msgs, list) and len(msgs) > MAX_MESSAGES:  # before validating them one by one
            raise ValueError(f"prompt {i}: messages must hold 1 to {MAX_MESSAGES} messages")
        try:
            parsed = WarmupPrompt.model_validate(item)
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(x) for x in first["loc"])
            raise ValueError(f"prompt {i}: {where}: {first['msg']}") from None
        out.append(_prompt(parsed, i))
    return tuple(out)


async def load(kube: Kube, ns: str, spec: WarmupSpec, deadline: float) -> tuple[WarmPrompt, ...]:
    """The warm-up's prompts; RunFailure (InvalidPrompts, PromptsNotFound, an API reason) when there are none
    to send."""
    if spec.prompts_from is None:
        try:
            return inline(spec.prompts or [])
        except ValueError as exc:
            raise RunFailure(INVALID, f"spec.prompts: {exc}") from None
    ref = spec.prompts_from.config_map_key_ref
    where = f"ConfigMap {ns}/{ref.name}"
    data = await with_retries(where, lambda: kube.config_map(ns, ref.name), deadline)
    if data is None:
        raise RunFailure(NOT_FOUND, f"{where} (spec.promptsFrom) not found")
    if ref.key not in data:
        raise RunFailure(NOT_FOUND, f"{where} (spec.promptsFrom) has no key {ref.key!r}")
    try:
        return parse(data[ref.key])
    except ValueError as exc:
        raise RunFailure(INVALID, f"{where} key {ref.key!r}: {exc}") from None
