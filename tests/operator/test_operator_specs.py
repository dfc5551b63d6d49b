"""The typed specs (operator/specs.py) against the CRDs (crds/*.yaml): every default the schema gives is the
model's, every default the model gives is the schema's, the same fields are required, and the models know
every field the schema has.
The image does not ship crds/, so this is what keeps the two the same."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import BaseModel

from kvpilot.operator.cli import RESET_TIMEOUT_S
from kvpilot.operator.specs import FleetSpec, ResetSpec, WarmupSpec, WeightUpdateSpec
from kvpilot.operator.weights.cli import UPDATE_TIMEOUT_S

ROOT = Path(__file__).resolve().parents[2]
CRDS = {
    "inferencedeployments.yaml": FleetSpec,
    "prefixcachereset.yaml": ResetSpec,
    "prefixcachewarmup.yaml": WarmupSpec,
    "weightupdates.yaml": WeightUpdateSpec,
}


def _spec_schema(crd_file: str) -> dict[str, Any]:
    crd = yaml.safe_load((ROOT / "crds" / crd_file).read_text())
    (version,) = crd["spec"]["versions"]
    return version["schema"]["openAPIV3Schema"]["properties"]["spec"]


def _submodel(annotation: Any) -> type[BaseModel] | None:
    """The model class a field holds (`X` or `X | None`), None for a plain value."""
    for t in (annotation, *getattr(annotation, "__args__", ())):
        if isinstance(t, type) and issubclass(t, BaseModel):
            return t
    return None


def _compare(schema: dict[str, Any], model: type[BaseModel], where: str) -> list[str]:
    bad = []
    props = schema.get("properties") or {}
    by_alias = {f.alias or name: (name, f) for name, f in model.model_fields.items()}
    for key in props.keys() - by_alias.keys():
        bad.append(f"{where}.{key}: in the CRD, not in {model.__name__}")
    for key in by_alias.keys() - props.keys():
        bad.append(f"{where}.{key}: in {model.__name__}, not in the CRD")
    for key in props.keys() & by_alias.keys():
        prop, (_, field) = props[key], by_alias[key]
        if field.is_required() != (key in schema.get("required", ())):
            bad.append(f"{where}.{key}: required in only one of the CRD and {model.__name__}")
        default = None if field.is_required() else field.get_default(call_default_factory=True)
        sub = _submodel(field.annotation)
        if isinstance(default, BaseModel):
            default = default.model_dump(by_alias=True, exclude_defaults=True)
        if "default" in prop:
            if default != prop["default"]:
                bad.append(f"{where}.{key}: CRD default {prop['default']!r}, {model.__name__} {default!r}")
        elif default is not None:
            bad.append(f"{where}.{key}: {model.__name__} defaults to {default!r}, the CRD to nothing")
        if sub is not None:
            bad += _compare(prop, sub, f"{where}.{key}")
    return bad


@pytest.mark.parametrize("crd_file", sorted(CRDS))
def test_spec_models_have_the_crds_fields_and_defaults(crd_file: str) -> None:
    assert _compare(_spec_schema(crd_file), CRDS[crd_file], "spec") == []


def test_the_check_sees_a_drifted_default() -> None:
    schema = _spec_schema("prefixcachereset.yaml")
    schema["properties"]["timeoutSeconds"]["default"] = 61
    assert _compare(schema, ResetSpec, "spec") == ["spec.timeoutSeconds: CRD default 61, ResetSpec 60"]


def test_a_spec_as_the_api_server_serves_it_and_one_built_by_hand_read_alike() -> None:
    # What a test or the catch-up builds (no defaults filled in) and what the API server serves (all of them).
    assert ResetSpec.parse({"targetRef": {"name": "f"}}) == ResetSpec.parse(
        {
            "targetRef": {"name": "f"},
            "engine": "kvpilot",
            "resetRunningRequests": False,
            "resetExternal": True,
            "verify": True,
            "timeoutSeconds": 60,
            "maxConcurrency": 64,
            "retriesPerPod": 3,
            "minSuccessRatio": 1,
            "waitForTarget": False,
            "allowNoTargets": False,
        }
    )
    fleet = FleetSpec.parse({"engine": {"dataParallelSize": 2}, "router": {"enabled": True}})
    assert (
        fleet.engine.block_size == 16 and fleet.router is not None and fleet.router.policy == "prefix-aware"
    )
    assert fleet.network_policy.enabled and fleet.port == 8000
    with pytest.raises(ValueError, match="frozen"):
        fleet.port = 1  # type: ignore[misc]


def test_the_clis_defaults_are_the_crds() -> None:
    assert RESET_TIMEOUT_S == _spec_schema("prefixcachereset.yaml")["properties"]["timeoutSeconds"]["default"]
    assert UPDATE_TIMEOUT_S == _spec_schema("weightupdates.yaml")["properties"]["timeoutSeconds"]["default"]
