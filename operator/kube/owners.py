"""Who owns a live object (its metadata.ownerReferences): the one place these checks are written."""

from __future__ import annotations

from typing import Any

from kvpilot.kube.fleet_members import controlled_by, controller_ref  # shared with the router: who runs a pod

__all__ = ["controlled_by", "controller_ref", "holder", "owned_by", "owner_of_kind"]


def owner_of_kind(obj: dict[str, Any], api_version: str, kind: str) -> dict[str, Any] | None:
    """The first owner reference of that apiVersion and kind, if any (e.g. the InferenceDeployment)."""
    refs = obj["metadata"].get("ownerReferences") or []
    return next((r for r in refs if r.get("kind") == kind and r.get("apiVersion") == api_version), None)


def owned_by(obj: dict[str, Any], uid: str) -> bool:
    """Whether the object `uid` is among the object's owners."""
    return any(r.get("uid") == uid for r in obj["metadata"].get("ownerReferences") or [])


def holder(obj: dict[str, Any]) -> str:
    """Who controls the object, for a message: "KIND NAME", or that nobody does."""
    ref = controller_ref(obj)
    return f"{ref['kind']} {ref['name']}" if ref else "someone else (no controller owner)"
