"""Where a request goes: `prefix-aware` (kvpilot pods' default), `round-robin` or `least-load`, each a
`Policy`.

prefix-aware scores each ready pod by the work the request would cost there: the prompt tokens it would
have to compute (those not in the pod's cached prefix, as its KV events say or as the router just sent
there: index.py, "Expected blocks"), what storing them would evict from the pod's pool, and a charge per
request the pod is already serving. The cheapest pod wins; ties go to the least loaded, then round-robin.
So a shared system prompt keeps landing where it is cached until that pod is busier than a recompute and
a second copy's evictions are worth. A prompt cached nowhere goes to the pool that would lose least to it,
unless it was sent before: then the rank it was sent to last is charged nothing for what it would evict,
and wins ties. One with no home there goes to an idle rank before a busy one.

A data-parallel pod publishes one event stream per rank, each rank with its own cache: prefix-aware then
scores each (pod, rank) and the decision names the rank, which the router sends as vLLM's
`X-data-parallel-rank` header, so the request lands on the very cache the score was computed for.

A rank whose weights are named hashes its keys with the version (`weight_versions.py`), so a request's
prompt is keyed once per hash scheme, (block size, weight version), and each rank is looked up with the
keys of its own scheme. A pod with a rank whose version is unknown is routed by load.
"""

from __future__ import annotations

import itertools
from abc import ABC, abstractmethod
from collections import OrderedDict
from dataclasses import dataclass

from kvpilot.router.fleet.pods import Pod
from kvpilot.router.kv.index import PrefixIndex
from kvpilot.router.routing.prompts import Prompts, Scheme

# Prompts whose last rank is remembered (by their first block's key): ~150 bytes each.
MAX_HOMES = 1 << 16


@dataclass(frozen=True, slots=True)
class Decision:
    pod: Pod
    reason: str  # prefix | load | round-robin
    predicted_cached_tokens: int | None = None  # None: no prediction (the pod publishes no events)
    rank: int | None = None  # the data-parallel rank to run on (None: the pod chooses)


# A keyed pod's index entries (pod name, rank), each with the hash scheme the request's prompts are looked
# up there with.
RankSchemes = dict[tuple[str, int], Scheme]


def _schemes(pod: Pod, model: str | None = None) -> RankSchemes | None:
    """Each rank of the pod and its hash scheme for a request naming `model`: the pod's block size, that
    rank's weight version, the pod's key scheme and the identity the pod gives the adapter `model` names
    (None: the base model). None where the pod is not keyed: its cache not followed, or a rank's weight
    version not known (it is routed by load)."""
    if pod.block_size is None or not pod.synced():
        return None
    versions = pod.rank_versions()
    if versions is None:
        return None
    bs, keys = pod.block_size, pod.keys
    lora = pod.adapters.get(model) if model is not None else None
    return {h: (bs, v, keys, lora) for h, v in zip(pod.holders(), versions, strict=True)}


def _keyed_pods(pods: list[Pod], model: str | None) -> dict[str, RankSchemes]:
    """The keyed ones of `pods`, by name, with their ranks' schemes for a request naming `model`."""
    return {p.name: ranks for p in pods if (ranks := _schemes(p, model)) is not None}


def hash_schemes(pods: list[Pod]) -> set[Scheme]:
    """The hash schemes prefix-aware keys a base-model request's prompts by, for these pods (computed
    before the body is read; an adapter's are computed when the policy asks for them)."""
    return {scheme for p in pods if (ranks := _schemes(p)) for scheme in ranks.values()}


def serving(pods: list[Pod], model: str | None) -> list[Pod]:
    """The pods that serve the LoRA adapter `model` names, when some do (the others would answer 404);
    else all of them."""
    if model is None:
        return pods
    return [p for p in pods if model in p.adapters] or pods


class Policy(ABC):
    """A routing policy: picks the pod (and rank) for one request among the ready pods of one weight
    version. Each policy's ties go round-robin, so equal pods share the load."""

    name: str  # as `--policy` names it, and the metrics' `policy` label
    needs_prompts = False  # whether `choose` is given the request's prompts (tokenized and keyed)

    def __init__(self) -> None:
        self._turn = itertools.count()

    def order(self, pods: list[Pod]) -> list[Pod]:
        """`pods` rotated by one more place each call: the tie-break order."""
        k = next(self._turn) % len(pods)
        return pods[k:] + pods[:k]

    @abstractmethod
    def choose(self, pods: list[Pod], prompts: Prompts | None) -> Decision:
        """The decision for one request; `pods` is not empty."""


class RoundRobin(Policy):
    name = "round-robin"

    def choose(self, pods: list[Pod], prompts: Prompts | None) -> Decision:
        return Decision(self.order(pods)[0], "round-robin")


class LeastLoad(Policy):
    """Fewest requests on the pod (`Pod.load`: the router's own open requests, or the pod's metrics where
    its engine publishes them); ties go round-robin."""

    name = "least-load"

    def choose(self, pods: list[Pod], prompts: Prompts | None) -> Decision:
        return Decision(min(self.order(pods), key=Pod.load), "load")


class PrefixAware(Policy):
    name = "prefix-aware"
    needs_prompts = True

    def __init__(self, index: PrefixIndex, tokens_per_running_request: int = 32) -> None:
        super().__init__()
        self.index = index
        # What one request already open on a pod costs a newcomer there, in prompt tokens to compute.
        # With continuous batching a decoding neighbour adds about one token of work per step, far less
        # than a recomputed prefix, so a cached prefix of P tokens stays put until its pod has P/32 more
        # requests open than another with an empty pool (one spill then also warms a second pod for that
        # prefix); 4 for a 128-token system prompt, the daemon's own rank slack (docs/router.md,
        # "Benchmark", has the runs). Into a fuller pool it takes more: `eviction_weight`.
        self.load_tokens = tokens_per_running_request
        # What one cached token a prompt's new blocks would evict costs, in tokens to compute: twice, since
        # the next request for that prefix computes it again, and that prompt, landing in a full pool too,
        # evicts another in turn (docs/performance.md, "Four routers on one load", has the runs). It makes
        # a spill cost more as pools fill: a prefix of P tokens leaves its pod at about (1 + 2f)P/32 more
        # requests open there than elsewhere, f the other pool's fill: P/32 into an empty pool, 3P/32 into
        # a full one (a second copy evicts as much of others' prompts: docs/performance.md, "Evictions
        # charged to every prompt").
        self.eviction_weight = 2
        # A prompt's first block key -> the rank it was last sent to (its "home") and when (a count of
        # sends), the oldest dropped first. Pods of different key schemes key a prompt differently, so it
        # may have a home under each: the latest send wins.
        self._homes: OrderedDict[int, tuple[tuple[str, int], int]] = OrderedDict()
        self._sends = itertools.count()

    def predict(
        self, pods: list[Pod], prompts: Prompts, expected: bool = False
    ) -> dict[tuple[str, int], int]:
        """Prompt tokens each (pod, rank) would serve from its cache, per the index (with `expected`, also
        from the prompts just sent there whose events have not come yet); pods whose events are not
        followed are left out."""
        matches = self._matches(_keyed_pods(pods, prompts.model), prompts)
        return {holder: tokens[expected] for holder, tokens in matches.items()}

    def _matches(
        self, schemes: dict[str, RankSchemes], prompts: Prompts
    ) -> dict[tuple[str, int], tuple[int, int]]:
        """Prompt tokens each rank of `schemes` (a keyed pod's, by pod name) holds in its cache, and holds
        or was just sent (index.py, "Expected blocks")."""
        out: dict[tuple[str, int], tuple[int, int]] = {}
        by_scheme: dict[Scheme, list[tuple[str, int]]] = {}
        for ranks in schemes.values():
            for holder, scheme in ranks.items():
                by_scheme.setdefault(scheme, []).append(holder)
                out[holder] = (0, 0)
        # A rank is looked up only with keys of its own version: blocks of other weights never match.
        for scheme, holders in by_scheme.items():
            # keyed in the prompt threads for a body read there, else here, once per scheme (Prompts)
            for keys in prompts.index_keys(scheme):
                for holder, (held, likely) in self.index.matches(keys, holders).items():
                    before = out[holder]
                    out[holder] = (before[0] + held * scheme[0], before[1] + likely * scheme[0])
        return out

    def choose(self, pods: list[Pod], prompts: Prompts | None) -> Decision:
        if prompts is None:
            return Decision(min(self.order(pods), key=lambda p: p.in_flight), "load")
        order = self.order(serving(pods, prompts.model))
        n = sum(map(len, prompts.token_ids))
        schemes = _keyed_pods(order, prompts.model)  # read once for this request
        # Scored on what each rank holds or was just sent (index.py, "Expected blocks").
        matches = self._matches(schemes, prompts)
        # Candidates: each rank of a pod whose events are followed, else the pod itself (rank None).
        candidates: list[tuple[Pod, int | None, int | None]] = []  # pod, rank, likely cached tokens
        for pod in order:
            ranks = schemes.get(pod.name)
            if ranks:
                candidates += [(pod, holder[1], matches[holder][1]) for holder in ranks]
            else:
                candidates.append((pod, None, None))

        evicted = self._evictions(candidates, n)
        cold = not any(cached for _, _, cached in candidates)
        # Only a prompt cached nowhere has a home to go back to (one cached somewhere goes where it is).
        home = self._home(candidates, prompts, schemes) if cold else None
        if home is not None:
            evicted[home] = 0
        # A rank's own open requests when the pod has several (they do not share a cache or a batch).
        loads = [
            pod.rank_load(rank) if rank is not None and pod.num_ranks > 1 else pod.in_flight
            for pod, rank, _ in candidates
        ]
        # A prompt cached nowhere with no home among these ranks goes to an idle one (no request of this
        # router open there) before a busy one, whatever their pools hold: on a busy rank it may wait
        # behind a prefill computing now, where what it evicts costs a later request only if that request
        # comes back for it (docs/performance.md, "An idle rank first"). Among idle ranks, or where none
        # is, room and load decide.
        idle_first = cold and home is None

        def score(i: int) -> tuple[bool, float, float, bool, int]:
            load = loads[i]
            cost = n - (candidates[i][2] or 0) + evicted[i] + self.load_tokens * load
            return (idle_first and load > 0, cost, load, i != home, i)

        pod, rank, cached = candidates[min(range(len(candidates)), key=score)]
        predicted = None
        if rank is not None:
            # Reported as predicted: what the chosen rank's events confirmed (the pod's cached_tokens is
            # compared with it), counted for that rank alone.
            holder = (pod.name, rank)
            scheme = schemes[pod.name][holder]
            predicted = matches[holder][0]
            for keys in prompts.index_keys(scheme):
                self.index.expect_keys(holder, keys)
            self._remember_home(prompts, scheme, holder)
        # A single-rank pod gets no header: any engine serves it (vLLM without DP, or a kvpilot daemon).
        return Decision(pod, "prefix" if cached else "load", predicted, rank if pod.num_ranks > 1 else None)

    def _home(
        self,
        candidates: list[tuple[Pod, int | None, int | None]],
        prompts: Prompts,
        schemes: dict[str, RankSchemes],
    ) -> int | None:
        """The candidate rank this prompt was last sent to, if it is one: a prompt cached nowhere goes back
        there rather than to the emptier pool (see `_evictions`). Sent to the same rank each time, a hot
        prompt is used at its full rate by that rank's LRU; spread over the pods as a cold prompt, each sees
        it at a fraction of that rate, and a small pool evicts it between two of its uses everywhere, which
        an exact index then places like any cold prompt again (docs/performance.md, "A family of generated
        loads")."""
        home, latest = None, -1
        for i, (pod, rank, _) in enumerate(candidates):
            if rank is not None:
                holder = (pod.name, rank)
                first = _first_key(prompts, schemes[pod.name][holder])
                sent = self._homes.get(first) if first is not None else None
                if sent is not None and sent[0] == holder and sent[1] > latest:
                    home, latest = i, sent[1]
        return home

    def _remember_home(self, prompts: Prompts, scheme: Scheme, holder: tuple[str, int]) -> None:
        first = _first_key(prompts, scheme)
        if first is None:
            return
        homes = self._homes
        homes[first] = (holder, next(self._sends))
        homes.move_to_end(first)
        if len(homes) > MAX_HOMES:
            homes.popitem(last=False)

    def _evictions(self, candidates: list[tuple[Pod, int | None, int | None]], n: int) -> list[int]:
        """The tokens of cached blocks each candidate's pool would lose to the blocks the prompt would
        store there (those it does not hold), times `eviction_weight`. A pool as full as `fill` (the share
        of its blocks cached or just sent) gives that share of a newcomer's blocks to cached ones, sooner
        or later: all of them in a full pool, none in an empty one. Equal on pools filled alike (load
        decides), it sends a prompt cached nowhere to the pod with more room (among the idle ones, where
        one is and the prompt has no home: `choose`), as sglang-router sends it to its smallest tree:
        after a reset, to the pod just reset; before, to the pod holding fewer prompts, which would
        otherwise evict one of its own later. A prompt cached on one pod is charged less there, where it
        stores only its new blocks, than where it would be stored whole a second time. Zero for all unless
        every candidate is a rank whose pool size is known."""
        out = []
        for pod, rank, cached in candidates:
            fill = None if rank is None or not pod.block_size else self.index.fill((pod.name, rank))
            if fill is None or not pod.block_size:  # (fill is None without a block size)
                return [0] * len(candidates)
            stored = (n - (cached or 0)) // pod.block_size * pod.block_size
            out.append(round(stored * fill * self.eviction_weight))
        return out


def _first_key(prompts: Prompts, scheme: Scheme) -> int | None:
    """The index's key of the request's first prompt's first block under `scheme` (None: no full block)."""
    keys = prompts.index_keys(scheme)
    return keys[0][0] if keys and keys[0] else None


def make_policy(name: str, index: PrefixIndex) -> Policy:
    """The policy `--policy NAME` names (settings.POLICIES)."""
    if name == "prefix-aware":
        return PrefixAware(index)
    if name == "round-robin":
        return RoundRobin()
    if name == "least-load":
        return LeastLoad()
    raise ValueError(f"unknown policy {name!r}")
