"""Which ready pods a request may go to when the fleet serves more than one weight version (a Rolling
WeightUpdate half done, a pod brought back on other weights): every request goes to pods of one version,
the one it pins (`weight_version` in its body, as the daemon takes it: 409 `weight_version_mismatch` when
no ready pod serves it), else the newest version that has a ready pod.

"Newest" is the order in which the router first saw each version served by any pod of the fleet (a
version appears when a pod swaps to it, named in its KV events or /health: `saw`).
Versions first seen together, at the router's start, are ordered naturally ("v2" before "v10"). The order
keeps the last MAX_VERSIONS versions. A pod whose ranks disagree, or whose version is unknown, serves no
version: it gets requests only while no pod of a known version is ready.
"""

from __future__ import annotations

import itertools
import json
import re
from typing import TYPE_CHECKING

from kvpilot.protocol.errors import ApiError

if TYPE_CHECKING:
    from kvpilot.router.fleet.pods import Pod
from kvpilot.router.kv.weight_versions import UNKNOWN, UNNAMED

PIN = b'"weight_version"'  # only a body naming it is parsed for it


def pod_version(pod: Pod) -> str | None:
    """The one version every rank of the pod serves ("initial" for unnamed weights); None if they differ
    or one is unknown. (`Pod.versions()` without building it: this runs for every pod on every request.)"""
    streams = pod.streams
    v = streams[0].weight_version if streams else pod.weight_version
    for s in streams:
        if s.weight_version != v:
            return None
    if len(streams) < len(pod.ranks) and pod.weight_version != v:  # a rank without a stream: /health's
        return None
    if v is UNKNOWN:
        return None
    # v is a str or None here: mypy narrows no `is` test against a sentinel instance (UNKNOWN)
    return UNNAMED if v is None else v  # type: ignore[return-value]


def pinned_version(raw: bytes) -> str | None:
    """The `weight_version` a request body pins, if it is a JSON object naming a string one (anything else
    is the daemon's to refuse)."""
    if PIN not in raw:
        return None
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError):
        return None
    value = body.get("weight_version") if isinstance(body, dict) else None
    return value if isinstance(value, str) else None


def _natural(version: str) -> list[tuple[int, int | str]]:
    return [(1, int(part)) if part.isdigit() else (0, part) for part in re.split(r"(\d+)", version)]


MAX_VERSIONS = 256  # remembered at most (the oldest go first); a fleet serves one or two at a time


class VersionChoice:
    def __init__(self) -> None:
        self._seen: dict[str, int] = {}  # version -> when first seen (a counter), oldest first
        self._clock = itertools.count()

    def saw(self, version: object) -> None:
        """A pod rank serves `version` from now on (its /health or KV events named it): a version not seen
        before is the newest."""
        if version is None:
            version = UNNAMED
        if isinstance(version, str) and version not in self._seen:
            self._note([version])

    def _note(self, versions: list[str]) -> None:
        """Versions not seen before are the newest, in natural order among themselves."""
        for v in sorted((v for v in versions if v not in self._seen), key=_natural):
            self._seen[v] = next(self._clock)
        while len(self._seen) > MAX_VERSIONS:
            del self._seen[next(iter(self._seen))]

    def eligible(self, ready: list[Pod], pinned: str | None) -> list[Pod]:
        """The pods among `ready` that a request pinning `pinned` (None: no pin) may go to."""
        versions = [pod_version(p) for p in ready]
        if pinned is None and versions.count(versions[0]) == len(versions):  # one version: the usual case
            if versions[0] is not None and versions[0] not in self._seen:
                self._note([versions[0]])
            return ready
        groups: dict[str | None, list[Pod]] = {}
        for p, v in zip(ready, versions, strict=True):
            groups.setdefault(v, []).append(p)
        known = [v for v in groups if v is not None]
        if any(v not in self._seen for v in known):
            self._note(known)
        if pinned is not None:
            if pinned not in groups:
                served = ", ".join(sorted(known)) or "none known"
                raise ApiError(
                    409,
                    f"weight_version {pinned!r} is not served by any ready pod (they serve: {served})",
                    "weight_version",
                    code="weight_version_mismatch",
                )
            return groups[pinned]
        if len(groups) <= 1 or not known:
            return ready
        return groups[max(known, key=self._seen.__getitem__)]
