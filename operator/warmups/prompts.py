"""A PrefixCacheWarmup's prompts: inline in its spec (bounded by the CRD's schema) or from a ConfigMap key
(`promptsFrom.configMapKeyRef`), a JSON or YAML list of the same items, bounded and checked by
kvpilot/fanout/warm_prompts.py, since the API server knows nothing of a ConfigMap's contents. A bad list
fails the warm-up before any pod is called, with reason InvalidPrompts and a message that names the item
and what is wrong with it.

The ConfigMap's text goes to the targeted pods as prompts, never into a status (only counts and verdicts
do). Like any ConfigMap it is not a secret store: a user who may create a warm-up in a namespace can have
any ConfigMap there sent to pods it selects, as one who may create pods there could mount it.
"""

from __future__ import annotations

from kvpilot.fanout import warm_prompts
from kvpilot.fanout.warmup import WarmPrompt
from kvpilot.operator.kube.api import Kube
from kvpilot.operator.kube.retries import RunFailure, with_retries
from kvpilot.operator.specs import WarmupPrompt, WarmupSpec

INVALID = "InvalidPrompts"
NOT_FOUND = "PromptsNotFound"


def inline(items: list[WarmupPrompt]) -> tuple[WarmPrompt, ...]:
    """spec.prompts, which the API server has checked against the same bounds (warm_prompts' checks run
    again: one rule for every source of prompts)."""
    return warm_prompts.from_items([item.model_dump(exclude_none=True) for item in items])


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
        return warm_prompts.parse(data[ref.key])
    except ValueError as exc:
        raise RunFailure(INVALID, f"{where} key {ref.key!r}: {exc}") from None
