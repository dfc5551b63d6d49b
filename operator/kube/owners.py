"""Who owns a live object (its metadata.ownerReferences): the one place these checks are written."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, cast

from kvpilot.kube.fleet_members import controlled_by, controller_ref  # shared with the router: who runs a pod

if TYPE_CHECKING:
    import kopf

__all__ = ["as_body", "controlled_by", "controller_ref", "holder", "owned_by", "owner_of_kind"]


def owner_of_kind(obj: Mapping[str, Any], api_version: str, kind: str) -> dict[str, Any] | None:
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


def as_body(obj: Mapping[str, Any]) -> kopf.Body:
    """An object where kopf's annotations ask for its Body: kopf.event and kopf.adopt read any mapping (its
    apiVersion, kind and metadata), an object read from the API as well as a handler's body."""
    return cast("kopf.Body", obj)
