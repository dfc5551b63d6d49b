"""The InferencePool of a fleet whose router is its endpoint picker (`spec.router.endpointPicker`): a pure
function of its spec, in the Gateway API Inference Extension's v1 API (inference.networking.k8s.io/v1, GAIE
v1.0 onwards; its fields are the ones that every v1 release has).

A gateway that routes an HTTPRoute to the pool asks the picker (the router's `grpc-epp` port, over Envoy's
ext_proc) which pod takes each request, then sends it to that pod's target port itself: the pool selects the
same pods as the fleet's Service (fenced pods excluded), on the daemons' HTTP port.
"""

from __future__ import annotations

from typing import Any

from kvpilot.operator.fleets.builders import MANAGED_BY, pod_labels, router_spec, serving_selector
from kvpilot.operator.fleets.router_objects import router_name
from kvpilot.operator.specs import EndpointPickerSpec, FleetSpec

GROUP = "inference.networking.k8s.io"
VERSION = "v1"
PLURAL = "inferencepools"
CRD_NAME = f"{PLURAL}.{GROUP}"
CONDITION = "InferencePoolReady"
# What GAIE's release notes tell a cluster admin to apply; named in the CRDNotInstalled message.
INSTALL_HINT = (
    "install the Gateway API Inference Extension's CRDs (kubectl apply -f https://github.com/kubernetes-sigs/"
    "gateway-api-inference-extension/releases/download/<version>/manifests.yaml); the pool is made once "
    "they are served"
)


def endpoint_picker(spec: FleetSpec) -> EndpointPickerSpec | None:
    """`spec.router.endpointPicker` when the router runs and serves as the picker, else None."""
    r = router_spec(spec)
    return r.endpoint_picker if r and r.endpoint_picker.enabled else None


def pool_name(name: str) -> str:
    return name


def inference_pool(name: str, spec: FleetSpec) -> dict[str, Any]:
    picker = endpoint_picker(spec)
    assert picker is not None
    labels = {k: v for k, v in pod_labels(name).items() if k != "app.kubernetes.io/component"}
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "InferencePool",
        "metadata": {"name": pool_name(name), "labels": {**labels, **MANAGED_BY}},
        "spec": {
            "selector": {"matchLabels": serving_selector(name)},
            "targetPorts": [{"number": spec.port}],
            # A Service reference needs its port (the Service port, which is the container's here).
            "endpointPickerRef": {
                "kind": "Service",
                "name": router_name(name),
                "port": {"number": picker.port},
            },
        },
    }
