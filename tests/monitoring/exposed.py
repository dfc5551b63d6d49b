"""Sample names the daemon and the operator really expose, read from their own metric registries, and those a
running router serves on /metrics."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families


def _sample_names(families: Iterable[Metric]) -> set[str]:
    """Every sample name of these families, whether or not a labelled one has samples yet."""
    names = set()
    for family in families:
        if family.type == "histogram":
            names |= {family.name + s for s in ("_bucket", "_sum", "_count")}
        elif family.type == "counter":
            names.add(family.name + "_total")
        else:
            names.add(family.name)
    return names


def daemon_metric_names() -> set[str]:
    from kvpilot.daemon.engine.outputs import CacheStats, TierStats
    from kvpilot.daemon.server.metrics import DaemonMetrics

    required = [
        f
        for f in dataclasses.fields(CacheStats)
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    ]
    # with both offload tiers on: their families exist only then (--kv-offloading-size, --kv-offloading-dir)
    tiers = tuple(TierStats(tier, 0, 0, 0, 0, 0, 0) for tier in ("host", "disk"))
    stats = CacheStats(**{f.name: 0 for f in required}, offload=tiers)
    config = {"block_size": "16", "enable_prefix_caching": "true", "eviction_policy": "lru"}
    # one rank, unlabelled; with a KV connector (--kv-transfer-config): its transfer families exist only then
    metrics = DaemonMetrics(lambda: [(None, stats)], "model", "initial", config, transfer_reasons=("gone",))
    return _sample_names(metrics.registry.collect())


def operator_metric_names() -> set[str]:
    from kvpilot.operator import metrics

    return _sample_names(metrics.REGISTRY.collect())


def served_metric_names(metrics_text: str) -> set[str]:
    """Sample names in a /metrics answer (the families it declares, with or without samples)."""
    return _sample_names(text_string_to_metric_families(metrics_text))
