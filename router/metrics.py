"""The router's Prometheus metrics (prefix `kvpilot_router_`, listed with units in docs/metrics.md)."""

from __future__ import annotations

from typing import TypeVar, cast

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

from kvpilot.serving.build_info import register_build_info

_P = "kvpilot_router_"
_Metric = TypeVar("_Metric", Counter, Gauge)
# How a disaggregated request went (router/disaggregation.py): only `transferred` gave the decode pod the
# prefill's KV; in every other the decode pod computed the prompt itself.
PD_OUTCOMES = ("transferred", "prefill_failed", "no_kv_transfer_params", "no_prefill_pod", "unparsed")


class RouterMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        register_build_info(r)
        self.requests = Counter(
            _P + "requests_total",
            "Requests proxied to pods, by pod, policy and HTTP status (0: no reply)",
            ["pod", "policy", "code"],
            registry=r,
        )
        self.decisions = Counter(
            _P + "routing_decisions_total",
            "Routing decisions, by pod, policy and reason (prefix: a cached prefix won; load: load decided)",
            ["pod", "policy", "reason"],
            registry=r,
        )
        self.predicted = Counter(
            _P + "predicted_cached_tokens_total",
            "Prompt tokens the router predicted "
            "the chosen pod had cached (requests whose usage reported cached_tokens)",
            ["pod"],
            registry=r,
        )
        self.reported = Counter(
            _P + "reported_cached_tokens_total",
            "Prompt tokens the pod reported cached "
            "(usage.prompt_tokens_details.cached_tokens) for the same requests",
            ["pod"],
            registry=r,
        )
        self.stale = Counter(
            _P + "stale_predictions_total",
            "Requests for which the pod reported fewer cached "
            "tokens than the router predicted (its index held blocks the pod no longer had)",
            ["pod"],
            registry=r,
        )
        self.kv_batches = Counter(
            _P + "kv_event_batches_total",
            "KV event batches from pods: received live, "
            "replayed (fetched from the replay socket) or missed (lost for good)",
            ["pod", "result"],
            registry=r,
        )
        self.picker_requests = Counter(
            _P + "endpoint_picker_requests_total",
            "Requests the endpoint picker answered for a gateway, by result (picked, no_ready_pod, "
            "bad_request, too_large, timeout, busy: past its streams or buffered bytes, error)",
            ["result"],
            registry=r,
        )
        for result in ("picked", "no_ready_pod", "bad_request", "too_large", "timeout", "busy", "error"):
            self.picker_requests.labels(result)
        self.picker_buffered = Gauge(
            _P + "endpoint_picker_buffered_bytes",
            "Bytes of request bodies the endpoint picker holds over all streams (of --endpoint-picker-buffer-bytes)",
            registry=r,
        )
        self.indexed_blocks = Gauge(
            _P + "indexed_blocks", "Prefix blocks the router's index holds per pod", ["pod"], registry=r
        )
        self.in_flight = Gauge(
            _P + "in_flight_requests", "Requests the router has open on each pod", ["pod"], registry=r
        )
        self.pod_ready = Gauge(
            _P + "pod_ready", "1 when the pod answers /health with 200", ["pod"], registry=r
        )
        self.resets = Counter(
            _P + "fleet_resets_total",
            "POST /reset_prefix_cache through the router, by result (success, failed, no_pods, unauthorized)",
            ["result"],
            registry=r,
        )
        for result in ("success", "failed", "no_pods", "unauthorized"):
            self.resets.labels(result)
        self.pd_requests = Counter(
            _P + "pd_requests_total",
            "Requests prefilled on one pod and decoded on another (--prefill, --decode, a disaggregated "
            "--fleet), by outcome: "
            "transferred (the decode pod got the prefill's kv_transfer_params), prefill_failed, "
            "no_kv_transfer_params (the prefill's reply had none), no_prefill_pod (none ready on the decode "
            "pod's weights), unparsed (no JSON object the router reads); all but transferred were decoded "
            "without, the prompt computed on the decode pod",
            ["outcome"],
            registry=r,
        )
        # Each series once looked up: labels() validates and locks on every call, on the proxy's path.
        self._children: dict[tuple[int, tuple[str, ...]], Counter | Gauge] = {}

    def pd_mode(self) -> None:
        """The fleet's pods have roles (Fleet.disaggregated): each P/D outcome's series starts at 0 (a fleet of
        whole-request pods has no such requests, and shows none)."""
        for outcome in PD_OUTCOMES:
            self.pd_requests.labels(outcome)

    def child(self, metric: _Metric, *labels: str) -> _Metric:
        """`metric.labels(*labels)`, cached (series are never removed, so a cached one stays valid)."""
        key = (id(metric), labels)
        series = self._children.get(key)
        if series is None:
            series = self._children[key] = metric.labels(*labels)
        return cast(_Metric, series)  # the series cached under this metric's id are its own: of its kind

    def add_pod(self, pod: str) -> None:
        """Start a new pod's prediction and KV event counters at 0: a counter series born at its first
        stale prediction or missed batch is an increase that rate(), increase() and the alerts never see."""
        for counter in (self.predicted, self.reported, self.stale):
            counter.labels(pod)
        for result in ("received", "replayed", "missed"):
            self.kv_batches.labels(pod, result)

    def count_kv(self, pod: str, result: str, n: int) -> None:
        self.child(self.kv_batches, pod, result).inc(n)

    def render(self) -> bytes:
        return generate_latest(self.registry)
