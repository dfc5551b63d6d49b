"""The weight update metrics (names listed in docs/metrics.md): which weights serve, how updates end and
how long their phases take, and whether generation is paused."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

PREFIX = "kvpilot_"
RESULTS = ("success", "failed", "refused", "unauthorized")
# A stage reads a checkpoint (seconds to minutes); a swap copies it in (milliseconds to seconds).
DURATION_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 180.0, 600.0)


class WeightMetrics:
    def __init__(self, registry: CollectorRegistry, version: str) -> None:
        self.version_info = Gauge(
            PREFIX + "weight_version_info",
            "The weights being served: 1 for the version and digest in the labels.",
            ["version", "digest"],
            registry=registry,
        )
        self.updates = Counter(
            PREFIX + "weight_updates",
            "Weight update operations by result (success, failed: a rank failed, refused: 4xx, unauthorized).",
            ["result"],
            registry=registry,
        )
        for result in RESULTS:
            self.updates.labels(result)
        self.duration = Histogram(
            PREFIX + "weight_update_duration_seconds",
            "Time of each phase of a weight update (pause, start, update: staging, finish: the swap, resume).",
            ["phase"],
            buckets=DURATION_BUCKETS,
            registry=registry,
        )
        self.paused = Gauge(
            PREFIX + "generation_paused",
            "1 while generation is paused (/pause until /resume).",
            registry=registry,
        )
        self.serving(version, "")

    def serving(self, version: str, digest: str | None) -> None:
        self.version_info.clear()
        self.version_info.labels(version, digest or "").set(1)
