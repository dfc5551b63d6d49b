"""InferenceDeployment `engine.dataParallelSize` / `tensorParallelSize` reach the daemon's flags and the
pod's GPU request."""

from __future__ import annotations

from kvpilot.operator.fleets import builders
from kvpilot.operator.specs import FleetSpec


def test_rank_fields_become_serve_flags_and_gpus_per_pod() -> None:
    spec = {
        "engine": {"dataParallelSize": 2, "tensorParallelSize": 4},
        "resources": {"requests": {"cpu": "8", "nvidia.com/gpu": 1}, "limits": {"nvidia.com/gpu": 1}},
    }
    c = builders.container("llm", FleetSpec.parse(spec))
    args = c["args"]
    assert args[args.index("--data-parallel-size") + 1] == "2"
    assert args[args.index("--tensor-parallel-size") + 1] == "4"
    assert c["resources"] == {"requests": {"cpu": "8", "nvidia.com/gpu": 8}, "limits": {"nvidia.com/gpu": 8}}
    assert spec["resources"]["limits"]["nvidia.com/gpu"] == 1  # the spec itself is left alone


def test_cpu_pods_get_no_gpus_and_defaults_add_no_flags() -> None:
    c = builders.container(
        "llm", FleetSpec.parse({"engine": {"dataParallelSize": 2}, "resources": {"requests": {"cpu": "4"}}})
    )
    assert c["resources"] == {"requests": {"cpu": "4"}}
    assert "--tensor-parallel-size" not in c["args"]
    assert "--data-parallel-size" not in builders.container("llm", FleetSpec.parse({}))["args"]
