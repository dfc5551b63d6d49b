"""Who owns a live object (its metadata.ownerReferences): the one place these checks are written."""

from __future__ import annotations

from typing import Any


def controller_ref(obj: dict[str, Any]) -> dict[str, Any] | None:
    """The owner reference that controls the object (controller: true), if any."""
    return next((r for r in obj["metadata"].get("ownerReferences") or [] if r.get("controller")), None)


def owned_by(obj: dict[str, Any], uid: str) -> bool:
    """Whether the object `uid` is among the object's owners."""
    return any(r.get("uid") == uid for r in obj["metadata"].get("ownerReferences") or [])


def controlled_by(obj: dict[str, Any], uid: str) -> bool:
    """Whether the object `uid` controls the object."""
    return (controller_ref(obj) or {}).get("uid") == uid
