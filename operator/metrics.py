"""Operator metrics, served on their own port by main.py (names are a contract, listed with units in
docs/metrics.md)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal, TypeVar

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from kvpilot.fanout import PodResult
from kvpilot.operator.resets.status import ResetCounts
from kvpilot.serving.build_info import register_build_info

REGISTRY = CollectorRegistry()
_P = "kvpilot_operator_"
register_build_info(REGISTRY)
_M = TypeVar("_M", Counter, Gauge, Histogram)


def _metric(kind: type[_M], name: str, doc: str, *labels: str, **kw: Any) -> _M:
    """One of the operator's metrics: the name prefixed, in the operator's registry."""
    return kind(_P + name, doc, labels, registry=REGISTRY, **kw)


RESETS = _metric(Counter, "resets_total", "PrefixCacheResets finished, by final phase", "namespace", "result")
RESET_DURATION = _metric(
    Histogram,
    "reset_duration_seconds",
    "Seconds from a PrefixCacheReset's start to its completion",
    buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300),
)
POD_REQUESTS = _metric(
    Counter,
    "reset_pod_requests_total",
    "HTTP reset calls to pods, by verdict and HTTP code (0: no reply)",
    "result",
    "code",
)
VERIFICATIONS = _metric(
    Counter,
    "reset_verifications_total",
    "Pods of finished PrefixCacheResets verified by a canary, by verdict (cold, warm, unknown)",
    "namespace",
    "verdict",
)
RESET_PODS = _metric(
    Gauge, "reset_pods", "Pods per result of recent PrefixCacheResets", "namespace", "reset", "result"
)
INFERENCE_DEPLOYMENTS = _metric(Gauge, "inference_deployments", "InferenceDeployments reconciled")
READY_REPLICAS = _metric(
    Gauge, "ready_replicas", "Ready daemon pods per InferenceDeployment", "namespace", "deployment"
)
DESIRED_REPLICAS = _metric(
    Gauge,
    "desired_replicas",
    "Daemon pods wanted per InferenceDeployment (replicas, or the DaemonSet's scheduled nodes)",
    "namespace",
    "deployment",
)
RESETS_IN_PROGRESS = _metric(Gauge, "resets_in_progress", "PrefixCacheResets this operator is running now")
RECONCILE_ERRORS = _metric(
    Counter, "reconcile_errors_total", "Handler runs that raised (kopf retries them)", "kind"
)
WEIGHT_UPDATES = _metric(
    Counter, "weight_updates_total", "WeightUpdates finished, by final phase", "namespace", "result"
)
WEIGHT_UPDATE_DURATION = _metric(
    Histogram,
    "weight_update_duration_seconds",
    "Seconds from a WeightUpdate's start to its end",
    buckets=(1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800),
)
WEIGHT_UPDATES_IN_PROGRESS = _metric(Gauge, "weight_updates_in_progress", "WeightUpdates running now")
FLEET_WEIGHT_PODS = _metric(
    Gauge,
    "weight_version_pods",
    "Pods per weight version of each InferenceDeployment, as they answered after the last WeightUpdate",
    "namespace",
    "deployment",
    "version",
)
FENCED_PODS = _metric(
    Gauge,
    "fenced_pods",
    "Pods of each InferenceDeployment out of its Service because they are not on its weights, at the last look",
    "namespace",
    "deployment",
)
WARMUPS = _metric(
    Counter, "warmups_total", "PrefixCacheWarmups finished, by final phase", "namespace", "result"
)
WARMUP_DURATION = _metric(
    Histogram,
    "warmup_duration_seconds",
    "Seconds from a PrefixCacheWarmup's start to its completion",
    buckets=(0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800),
)
WARMUP_PODS = _metric(
    Counter,
    "warmup_pods_total",
    "Pods of finished PrefixCacheWarmups by verdict (warm, cold, unknown; none: not warmed, an error)",
    "namespace",
    "verified",
)
WARMUP_POD_REQUESTS = _metric(
    Counter,
    "warmup_pod_requests_total",
    "Prompt sends of PrefixCacheWarmups to pods, by result and HTTP code (0: no reply)",
    "result",
    "code",
)
WARMUP_REAPPLIES = _metric(
    Counter,
    "warmup_reapplies_total",
    "Pods warmed by Continuous PrefixCacheWarmups, by why (podJoined, podRestarted, reset, weightUpdate, retry)",
    "namespace",
    "trigger",
)
WARMUP_OLDEST_COLD = _metric(
    Gauge,
    "warmup_oldest_cold_pod_seconds",
    "Continuous PrefixCacheWarmups: seconds the pod owed warmth longest has been running and not verified warm (0: all warm)",
    "namespace",
    "warmup",
)
WARMUPS_IN_PROGRESS = _metric(Gauge, "warmups_in_progress", "PrefixCacheWarmups this operator is running now")
for _kind in (
    "InferenceDeployment",
    "PrefixCacheReset",
    "PrefixCacheWarmup",
    "WeightUpdate",
):  # 0 from the start: rate() needs the series
    RECONCILE_ERRORS.labels(_kind)
API_CALLS = _metric(
    Counter, "api_calls_total", "Kubernetes API calls made by the operator's own code", "verb", "resource"
)
# Per namespace and kind: a steady rate while no spec changes is an apply loop (a field the API server
# normalizes differently from what was sent), which a no-op apply hides from the objects themselves.
APPLIES = _metric(
    Counter,
    "applies_total",
    "Server-side applies of owned objects, by namespace and kind",
    "namespace",
    "kind",
)
STATUS_PATCHES = _metric(Counter, "reset_status_patches_total", "Status patches written to PrefixCacheResets")

_KEEP_RESETS = 50  # "for the latest resets": bounded label cardinality
_recent: list[tuple[str, str]] = []
# reset_pods' result label: the status counts of final results
_RESET_RESULTS: tuple[Literal["succeeded", "failed", "skipped", "notSupported"], ...] = (
    "succeeded",
    "failed",
    "skipped",
    "notSupported",
)


def record_reset_pods(namespace: str, reset: str, counts: ResetCounts) -> None:
    key = (namespace, reset)
    if key not in _recent:
        _recent.append(key)
    for result in _RESET_RESULTS:
        RESET_PODS.labels(namespace, reset, result).set(counts[result])
    while len(_recent) > _KEEP_RESETS:
        ns, name = _recent.pop(0)
        for result in _RESET_RESULTS:
            try:
                RESET_PODS.remove(ns, name, result)
            except KeyError:
                pass


def count_verifications(namespace: str, records: Sequence[PodResult]) -> None:
    """One per pod with a verdict, when its reset ends (so a restarted fan-out counts once)."""
    for r in records:
        if r.verified is not None:
            VERIFICATIONS.labels(namespace, r.verified).inc()


def count_pod_call(verdict: str, code: str) -> None:
    """The fan-out's on_call hook: one reset call to a pod (or a pod's deadline passing before its next)."""
    POD_REQUESTS.labels(verdict, code).inc()


def count_warmup_pods(namespace: str, records: Sequence[PodResult]) -> None:
    """One per pod called, when its warm-up ends (so a restarted warm-up counts once)."""
    for r in records:
        if r.result in ("Succeeded", "Failed", "NotSupported"):
            WARMUP_PODS.labels(namespace, r.verified or "none").inc()


def count_warmup_call(result: str, code: str) -> None:
    """The warm-up fan-out's on_call hook: one prompt send to a pod (or its deadline passing first)."""
    WARMUP_POD_REQUESTS.labels(result, code).inc()


def serve(port: int, addr: str = "0.0.0.0") -> None:
    start_http_server(port, addr=addr, registry=REGISTRY)
