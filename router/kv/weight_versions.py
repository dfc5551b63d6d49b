"""A pod rank's weight version as the router knows it: what its block keys are hashed with.

A kvpilot daemon whose weights are named (`--weight-version`, or after any weight update) adds the version
to every block key, so the router must hash a request's prompt with the same version to find that pod's
blocks. The version comes from two places: the pod's `GET /health` (`weight_version`) when the router
starts following it, and each AllBlocksCleared naming a `weight_version` in its KV events, at the very point of the
swap. The daemon's unnamed initial weights (health says "initial") add nothing to the keys: None.

What a pod sends is checked: a version is a non-empty string of at most MAX_CHARS characters; anything
else makes the rank's version UNKNOWN, and a pod with such a rank is routed by load (no key of its
could be computed).
"""

from __future__ import annotations

import json
from typing import Final

MAX_CHARS = 128
MAX_HEALTH_BYTES = 128 * 1024  # the daemon's reply is ~150 bytes, up to ~85 KiB naming LoRA adapters
UNNAMED = "initial"  # what the daemon's /health says for weights loaded without --weight-version


class _Unknown:
    def __repr__(self) -> str:
        return "UNKNOWN"


UNKNOWN: Final = _Unknown()
Version = str | None | _Unknown  # None: unnamed weights (keys without a version)


def checked(value: object) -> str | _Unknown:
    """A version a pod named (in an AllBlocksCleared event), or UNKNOWN when it is no short string."""
    return value if isinstance(value, str) and 0 < len(value) <= MAX_CHARS else UNKNOWN


def from_health(raw: bytes | None) -> Version:
    """The version in a kvpilot pod's /health reply (None: cut off at its size cap): a reply that names
    none (not a JSON object, or no `weight_version`) means keys without a version, as before versions
    existed; one that names no short string, or is too big, UNKNOWN."""
    if raw is None:
        return UNKNOWN
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError):
        return None
    if not isinstance(body, dict) or body.get("weight_version") is None:
        return None
    value = checked(body["weight_version"])
    return None if value == UNNAMED else value


def describe(version: Version) -> str | None:
    """As the router's /health shows it: the version, null for unnamed weights, "unknown"."""
    # mypy narrows no `is` test against a sentinel instance: past it, version is str | None
    return "unknown" if version is UNKNOWN else version  # type: ignore[return-value]
