"""Sample names the daemon and the operator really expose, read from their own metric registries."""

from __future__ import annotations

import dataclasses

from prometheus_client import CollectorRegistry


def _sample_names(registry: CollectorRegistry) -> set[str]:
    names = set()
    for family in registry.collect():
        if family.type == "histogram":
            names |= {family.name + s for s in ("_bucket", "_sum", "_count")}
        elif family.type == "counter":
            names.add(family.name + "_total")
        else:
            names.add(family.name)
    return names


def daemon_metric_names() -> set[str]:
    from kvpilot.daemon.engine.outputs import CacheStats
    from kvpilot.daemon.server.metrics import DaemonMetrics

    required = [f for f in dataclasses.fields(CacheStats)
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]  # fmt: skip
    stats = CacheStats(**{f.name: 0 for f in required})
    return _sample_names(DaemonMetrics(lambda: [(None, stats)]).registry)  # one rank, unlabelled


def operator_metric_names() -> set[str]:
    from kvpilot.operator import metrics

    return _sample_names(metrics.REGISTRY)
