"""Operator metrics, served on their own port by main.py (names are a contract, listed with units in
docs/metrics.md)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from kvpilot.build_info import register_build_info

REGISTRY = CollectorRegistry()
_P = "kvpilot_operator_"
register_build_info(REGISTRY)

RESETS = Counter(
    _P + "resets_total",
    "PrefixCacheResets finished, by final phase",
    ["namespace", "result"],
    registry=REGISTRY,
)
RESET_DURATION = Histogram(
    _P + "reset_duration_seconds",
    "Seconds from a PrefixCacheReset's start to its completion",
    buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300),
    registry=REGISTRY,
)
POD_REQUESTS = Counter(
    _P + "reset_pod_requests_total",
    "HTTP reset calls to pods, by verdict and HTTP code (0: no reply)",
    ["result", "code"],
    registry=REGISTRY,
)
RESET_PODS = Gauge(
    _P + "reset_pods",
    "Pods per result of recent PrefixCacheResets",
    ["namespace", "reset", "result"],
    registry=REGISTRY,
)
INFERENCE_DEPLOYMENTS = Gauge(
    _P + "inference_deployments", "InferenceDeployments reconciled", registry=REGISTRY
)
READY_REPLICAS = Gauge(
    _P + "ready_replicas",
    "Ready daemon pods per InferenceDeployment",
    ["namespace", "deployment"],
    registry=REGISTRY,
)
DESIRED_REPLICAS = Gauge(
    _P + "desired_replicas",
    "Daemon pods wanted per InferenceDeployment (replicas, or the DaemonSet's scheduled nodes)",
    ["namespace", "deployment"],
    registry=REGISTRY,
)
RESETS_IN_PROGRESS = Gauge(
    _P + "resets_in_progress", "PrefixCacheResets this operator is running now", registry=REGISTRY
)
RECONCILE_ERRORS = Counter(
    _P + "reconcile_errors_total", "Handler runs that raised (kopf retries them)", ["kind"], registry=REGISTRY
)
for _kind in ("InferenceDeployment", "PrefixCacheReset"):  # 0 from the start: rate() needs the series
    RECONCILE_ERRORS.labels(_kind)
API_CALLS = Counter(
    _P + "api_calls_total",
    "Kubernetes API calls made by the operator's own code",
    ["verb", "resource"],
    registry=REGISTRY,
)
STATUS_PATCHES = Counter(
    _P + "reset_status_patches_total", "Status patches written to PrefixCacheResets", registry=REGISTRY
)

_KEEP_RESETS = 50  # "for the latest resets": bounded label cardinality
_recent: list[tuple[str, str]] = []


def record_reset_pods(namespace: str, reset: str, counts: dict[str, int]) -> None:
    key = (namespace, reset)
    if key not in _recent:
        _recent.append(key)
    for result in ("succeeded", "failed", "skipped", "notSupported"):
        RESET_PODS.labels(namespace, reset, result).set(counts.get(result, 0))
    while len(_recent) > _KEEP_RESETS:
        ns, name = _recent.pop(0)
        for result in ("succeeded", "failed", "skipped", "notSupported"):
            try:
                RESET_PODS.remove(ns, name, result)
            except KeyError:
                pass


def count_pod_call(verdict: str, code: str) -> None:
    """The fan-out's on_call hook: one reset call to a pod (or a pod's deadline passing before its next)."""
    POD_REQUESTS.labels(verdict, code).inc()


def serve(port: int, addr: str = "0.0.0.0") -> None:
    start_http_server(port, addr=addr, registry=REGISTRY)
