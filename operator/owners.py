"""Who owns a live object (its metadata.ownerReferences): the one place these checks are written."""

from __future__ import annotations

from typing import Any


def controller_ref(obj: dict[str, Any]) -> dict[str, Any] | None:
    """The owner reference that controls the object (controller: true), if any."""
    return next((r for r in obj["metadata"].get("ownerReferences") or [] if r.get("controller")), None)


def owner_of_kind(obj: dict[str, Any], api_version: str, kind: str) -> dict[str, Any] | None:
    """The first owner reference of that apiVersion and kind, if any (e.g. the InferenceDeployment)."""
    refs = obj["metadata"].get("ownerReferences") or []
    return next((r for r in refs if r.get("kind") == kind and r.get("apiVersion") == api_version), None)


def owned_by(obj: dict[str, Any], uid: str) -> bool:
    """Whether the object `uid` is among the object's owners."""
    return any(r.get("uid") == uid for r in obj["metadata"].get("ownerReferences") or [])


def controlled_by(obj: dict[str, Any], uid: str) -> bool:
    """Whether the object `uid` controls the object."""
    return (controller_ref(obj) or {}).get("uid") == uid
