"""Where a request goes: `prefix-aware` (kvpilot pods' default), `round-robin` or `least-load`.

prefix-aware scores each ready pod by the work the request would cost there: the prompt tokens it would
have to compute (those not in the pod's cached prefix, as its KV events say) plus a charge per request the
pod is already serving. The cheapest pod wins; ties go to the least loaded, then round-robin. So a shared
system prompt keeps landing where it is cached until that pod is busier than a recompute is worth.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from kvpilot.daemon.engine.block_hash import prompt_block_hashes
from kvpilot.router.index import PrefixIndex
from kvpilot.router.pods import Pod
from kvpilot.router.prompts import Prompts


@dataclass(frozen=True, slots=True)
class Decision:
    pod: Pod
    reason: str  # prefix | load | round-robin
    predicted_cached_tokens: int | None = None  # None: no prediction (the pod publishes no events)


class RoundRobin:
    name = "round-robin"
    needs_prompts = False

    def __init__(self) -> None:
        self._turn = itertools.count()

    def order(self, pods: list[Pod]) -> list[Pod]:
        k = next(self._turn) % len(pods)
        return pods[k:] + pods[:k]

    def choose(self, pods: list[Pod], prompts: Prompts | None) -> Decision:
        return Decision(self.order(pods)[0], "round-robin")


class LeastLoad(RoundRobin):
    """Fewest requests on the pod (`Pod.load`: the router's own open requests, or the pod's metrics where
    its engine publishes them); ties go round-robin."""

    name = "least-load"

    def choose(self, pods: list[Pod], prompts: Prompts | None) -> Decision:
        return Decision(min(self.order(pods), key=Pod.load), "load")


class PrefixAware(RoundRobin):
    name = "prefix-aware"
    needs_prompts = True

    def __init__(self, index: PrefixIndex, tokens_per_running_request: int = 64) -> None:
        super().__init__()
        self.index = index
        # What one request already open on a pod costs a newcomer there, in prompt tokens to compute.
        # With continuous batching a decoding neighbour adds about one token of work per step, far less
        # than a recomputed prefix, so a cached prefix stays put until its pod is several requests
        # busier than the others (then one spill also warms a second pod for that prefix).
        self.load_tokens = tokens_per_running_request

    def predict(self, pods: list[Pod], prompts: Prompts) -> dict[str, int | None]:
        """Prompt tokens each pod would serve from its cache, per the index (None: no events followed).
        The engine always computes the last prompt token, so at most len-1 tokens' worth of blocks."""
        out: dict[str, int | None] = {p.name: None for p in pods}
        by_size: dict[int, list[str]] = {}
        for p in pods:
            if p.block_size is not None and p.synced():
                by_size.setdefault(p.block_size, []).append(p.name)
                out[p.name] = 0
        for bs, names in by_size.items():
            for ids in prompts.token_ids:
                usable = (len(ids) - 1) // bs
                keys = prompt_block_hashes(ids[: usable * bs], bs, prompts.cache_salt)
                for name, blocks in self.index.matched_blocks(keys, names).items():
                    out[name] = (out[name] or 0) + blocks * bs
        return out

    def choose(self, pods: list[Pod], prompts: Prompts | None) -> Decision:
        order = self.order(pods)
        if prompts is None:
            return Decision(min(order, key=lambda p: p.in_flight), "load")
        n = sum(len(ids) for ids in prompts.token_ids)
        predicted = self.predict(order, prompts)
        scored = []
        for rank, pod in enumerate(order):
            cost = n - (predicted[pod.name] or 0) + self.load_tokens * pod.in_flight
            scored.append((cost, pod.in_flight, rank))
        best = min(range(len(order)), key=lambda i: scored[i])
        pod = order[best]
        cached = predicted[pod.name]
        return Decision(pod, "prefix" if cached else "load", cached)
