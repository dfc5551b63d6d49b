"""Prometheus metrics of the daemon (names are a contract, listed with units in docs/metrics.md).

Two kinds, both on a per-app `CollectorRegistry` (so two servers in one process never collide):
- what the server observes per request (latency histograms, token counters, reset outcomes) is
  recorded as it happens with ordinary prometheus-client metrics;
- what the engine counts itself (prefix-cache queries and hits, blocks, queue lengths, preemptions,
  epoch) is read at scrape time from the snapshot the engine thread publishes after every step, by a
  custom collector. A scrape therefore never waits for a step and never touches the engine.

Three of the engine gauges are exported twice: as `kvpilot_*` and under vLLM's names and labels, which the
Gateway API Inference Extension's model-server protocol reads, so GAIE endpoint pickers schedule kvpilot pods
as they do vLLM ones. Both come from the same snapshot in the same scrape, so they never disagree.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import cast

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvpilot.daemon.engine.client import EngineInfo
from kvpilot.daemon.engine.outputs import CacheStats
from kvpilot.daemon.server.weights.metrics import WeightMetrics
from kvpilot.serving.build_info import register_build_info

PREFIX = "kvpilot_"

# CPU decode steps take 0.1-3 s, GPU ones a few ms: the buckets span both.
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
ITL_BUCKETS = (0.002, 0.005, 0.01, 0.02, 0.04, 0.06, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0, 640.0)

# (kvpilot name, vLLM's name, help, value) of the load gauges. vLLM labels its gauges with the served model
# name and the engine (data-parallel rank, "0" without data parallelism); GAIE pickers read them by name.
# `vllm:kv_cache_usage_perc` is, despite its name, a fraction (0-1) in vLLM too. `vllm:lora_requests_info`
# is vLLM's too: one series whose labels name the adapters running and waiting, its value the time.
LOAD_GAUGES: tuple[tuple[str, str, str, Callable[[CacheStats], float]], ...] = (
    (
        "kv_cache_usage_ratio",
        "vllm:kv_cache_usage_perc",
        "Share of KV cache blocks held by requests (0-1).",
        lambda s: s.usage_ratio,
    ),
    (
        "num_requests_running",
        "vllm:num_requests_running",
        "Requests in the running batch.",
        lambda s: s.num_running,
    ),
    (
        "num_requests_waiting",
        "vllm:num_requests_waiting",
        "Requests waiting to be scheduled.",
        lambda s: s.num_waiting,
    ),
)
VLLM_LABELS = ["model_name", "engine"]

# (kind, name, help, TierStats field) of the offload tiers' families.
OFFLOAD_FAMILIES = (
    (GaugeMetricFamily, "kv_offload_blocks", "KV blocks held in each offload tier.", "blocks"),
    (GaugeMetricFamily, "kv_offload_bytes", "Bytes of KV held in each offload tier.", "bytes"),
    (
        GaugeMetricFamily,
        "kv_offload_capacity_bytes",
        "Most bytes each offload tier may hold.",
        "capacity_bytes",
    ),
    (
        CounterMetricFamily,
        "kv_offload_hits",
        "Prompt tokens served from each offload tier (copied back into the KV cache instead of computed; "
        "part of kvpilot_prefix_cache_hits_total).",
        "hit_tokens",
    ),
    (
        CounterMetricFamily,
        "kv_offload_stored_blocks",
        "KV blocks written into each offload tier.",
        "stored_blocks",
    ),
    (
        CounterMetricFamily,
        "kv_offload_loaded_blocks",
        "KV blocks copied back from each offload tier into the KV cache.",
        "loaded_blocks",
    ),
)


class EngineCollector(Collector):
    """Engine-side counters and gauges from each rank's latest published `CacheStats`. With several
    data-parallel ranks every sample carries a `rank` label (sum over it for the daemon's total); with
    one, none, exactly as before ranks existed. The vLLM-named gauges always carry vLLM's labels."""

    def __init__(self, snapshot: Callable[[], list[tuple[str | None, CacheStats]]], model_name: str) -> None:
        self._snapshot = snapshot
        self._model_name = model_name

    def collect(self) -> Iterator[Metric]:
        ranks = self._snapshot()
        if not ranks:
            return
        rank_label = ["rank"] if ranks[0][0] is not None else []

        def family(
            kind: type[CounterMetricFamily | GaugeMetricFamily],
            name: str,
            doc: str,
            value: Callable[[CacheStats], float],
        ) -> Metric:
            m = kind(PREFIX + name, doc, labels=rank_label)
            for rank, s in ranks:
                named = [cast(str, rank)] if rank_label else []  # with the label every rank is named
                m.add_metric(named, value(s))
            return m

        C, G = CounterMetricFamily, GaugeMetricFamily
        yield family(
            C,
            "prefix_cache_queries",
            "Prompt tokens looked up in the prefix cache.",
            lambda s: s.query_tokens,
        )
        yield family(
            C, "prefix_cache_hits", "Prompt tokens found in the prefix cache.", lambda s: s.hit_tokens
        )
        yield family(
            G, "prefix_cache_epoch", "Prefix cache epoch; each reset bumps it by one.", lambda s: s.epoch
        )
        yield family(
            G,
            "prefix_cache_last_reset_timestamp_seconds",
            "Unix time of the last prefix cache reset (0: never reset).",
            lambda s: s.last_reset_time or 0.0,
        )
        blocks = GaugeMetricFamily(
            PREFIX + "kv_cache_blocks",
            "KV cache blocks by state: free (empty), cached (free but reusable by prefix), used (held).",
            labels=["state", *rank_label],
        )
        for rank, s in ranks:
            extra = [cast(str, rank)] if rank_label else []  # with the label every rank is named
            blocks.add_metric(["free", *extra], s.blocks_free)
            blocks.add_metric(["cached", *extra], s.blocks_cached)
            blocks.add_metric(["used", *extra], s.blocks_used)
        yield blocks
        for name, vllm_name, doc, value in LOAD_GAUGES:
            yield family(G, name, doc, value)
            compat = GaugeMetricFamily(vllm_name, f"{doc} Same as {PREFIX}{name}.", labels=VLLM_LABELS)
            for rank, s in ranks:
                compat.add_metric([self._model_name, rank or "0"], value(s))
            yield compat
        yield family(
            C, "num_preemptions", "Requests preempted to be recomputed later.", lambda s: s.num_preemptions
        )
        yield family(
            G,
            "prefix_cache_pinned_blocks",
            "KV blocks pinned by requests' pin_prefix: never evicted until unpinned or reset.",
            lambda s: s.pinned_blocks,
        )
        yield family(
            C,
            "prefix_cache_pins_refused",
            "Requests whose pin_prefix was refused: pinning it would pass --pinned-prefix-cap-ratio.",
            lambda s: s.pins_refused,
        )
        yield from self._lora_info([s for _, s in ranks])
        yield from self._offload(ranks, rank_label)

    @staticmethod
    def _lora_info(ranks: list[CacheStats]) -> Iterator[Metric]:
        """vLLM's `vllm:lora_requests_info`, which GAIE's pickers read for LoRA affinity: the adapters
        running and waiting (comma-separated) and the most a step runs, on one series whose value is the
        time it was read (vLLM's too: a reader takes the newest series). Nothing when LoRA is off."""
        total = CacheStats.total(ranks)
        if not total.max_loras:
            return
        m = GaugeMetricFamily(
            "vllm:lora_requests_info",
            "Running stats on lora requests.",
            labels=["max_lora", "waiting_lora_adapters", "running_lora_adapters"],
        )
        labels = [str(total.max_loras), ",".join(total.lora_waiting), ",".join(total.lora_running)]
        m.add_metric(labels, time.time())
        yield m
        yield CounterMetricFamily(
            PREFIX + "lora_reloads",
            "LoRA adapters read again from their directory because --max-cpu-loras had let them go: "
            "growing fast, the adapters in use do not fit (thrash)",
            value=total.lora_reloads,
        )

    @staticmethod
    def _offload(ranks: list[tuple[str | None, CacheStats]], rank_label: list[str]) -> Iterator[Metric]:
        """The offload tiers below the pool (`--kv-offloading-size`, `--kv-offloading-dir`), one `tier`
        series each ("host", "disk"); nothing when they are off."""
        if not ranks[0][1].offload:
            return
        for kind, name, doc, field in OFFLOAD_FAMILIES:
            m = kind(PREFIX + name, doc, labels=["tier", *rank_label])
            for rank, s in ranks:
                for t in s.offload:
                    named = [cast(str, rank)] if rank_label else []  # with the label every rank is named
                    m.add_metric([t.tier, *named], getattr(t, field))
            yield m


def cache_config_labels(info: EngineInfo) -> dict[str, str]:
    """The prefix cache's settings, as `kvpilot_cache_config_info`'s labels (vLLM's `cache_config_info`
    does the same): what a dashboard shows as the policy each pod runs."""
    cap = info.pinned_prefix_cap_ratio
    return {
        "block_size": str(info.block_size),
        "enable_prefix_caching": str(info.enable_prefix_caching).lower(),
        "eviction_policy": info.eviction_policy,
        "pinned_prefix_cap_ratio": "off" if cap is None else f"{cap:g}",
    }


# A pull's whole time, connect to last byte: loopback moves a 1k-token prompt in milliseconds, a slow
# network or a large context in seconds.
TRANSFER_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class TransferMetrics:
    """Prefill/decode disaggregation's KV transfers (docs/disaggregation.md): blocks and bytes each way,
    pulls that failed by reason (the decode pod computed the prompt instead), and the pulls' time. Every
    series exists at 0 from the start, so rate() and alerts work from the first scrape."""

    def __init__(self, r: CollectorRegistry, reasons: tuple[str, ...]) -> None:
        self.blocks = Counter(
            PREFIX + "kv_transfer_blocks",
            "KV blocks moved between prefill and decode pods.",
            ["direction"],
            registry=r,
        )
        self.bytes = Counter(
            PREFIX + "kv_transfer_bytes",
            "KV bytes moved between prefill and decode pods.",
            ["direction"],
            registry=r,
        )
        self.failures = Counter(
            PREFIX + "kv_transfer_failures",
            "KV pulls not landed, by reason (the decode pod computed the prompt instead).",
            ["reason"],
            registry=r,
        )
        self.seconds = Histogram(
            PREFIX + "kv_transfer_seconds",
            "Time of a decode pod's pull of a prefill's KV, connect to last byte.",
            buckets=TRANSFER_BUCKETS,
            registry=r,
        )
        for direction in ("sent", "received"):
            self.blocks.labels(direction)
            self.bytes.labels(direction)
        for reason in reasons:
            self.failures.labels(reason)

    def sent(self, blocks: int, nbytes: int) -> None:
        self.blocks.labels("sent").inc(blocks)
        self.bytes.labels("sent").inc(nbytes)

    def received(self, blocks: int, nbytes: int, seconds: float) -> None:
        self.blocks.labels("received").inc(blocks)
        self.bytes.labels("received").inc(nbytes)
        self.seconds.observe(seconds)

    def failed(self, reason: str) -> None:
        self.failures.labels(reason).inc()


class DaemonMetrics:
    def __init__(
        self,
        snapshot: Callable[[], list[tuple[str | None, CacheStats]]],
        model_name: str,
        weight_version: str,
        cache_config: dict[str, str],
        transfer_reasons: tuple[str, ...] = (),
    ) -> None:
        """`transfer_reasons`: the failure reasons of KV transfers, when this daemon has a KV connector
        (none: it has no transfer metrics)."""
        self.registry = CollectorRegistry()
        r = self.registry
        Gauge(
            PREFIX + "cache_config_info",
            "The prefix cache's settings as labels (always 1).",
            list(cache_config),
            registry=r,
        ).labels(**cache_config).set(1)
        self.weights = WeightMetrics(r, weight_version)
        self.resets = Counter(
            PREFIX + "prefix_cache_resets",
            "Prefix cache reset calls by result (success, failed, unavailable, unauthorized).",
            ["result"],
            registry=r,
        )
        for result in ("success", "failed", "unavailable", "unauthorized"):
            self.resets.labels(result)  # present at 0, so rate() works from the first scrape
        self.prompt_tokens = Counter(
            PREFIX + "prompt_tokens",
            "Prompt tokens of admitted requests (counted at their first token).",
            registry=r,
        )
        self.prompt_tokens_cached = Counter(
            PREFIX + "prompt_tokens_cached",
            "Prompt tokens of admitted requests served from the prefix cache (not computed).",
            registry=r,
        )
        self.generation_tokens = Counter(PREFIX + "generation_tokens", "Generated tokens.", registry=r)
        # Per LoRA adapter (`adapter`: its name; the base model's requests are not counted here). A series
        # goes when its adapter is unloaded, so they are bounded by the adapters served.
        self.lora_requests = Counter(
            PREFIX + "lora_requests", "Admitted requests (prompts) per LoRA adapter.", ["adapter"], registry=r
        )
        self.lora_prompt_tokens = Counter(
            PREFIX + "lora_prompt_tokens",
            "Prompt tokens of admitted requests per LoRA adapter.",
            ["adapter"],
            registry=r,
        )
        self.lora_prompt_tokens_cached = Counter(
            PREFIX + "lora_prompt_tokens_cached",
            "Prompt tokens per LoRA adapter served from the prefix cache (not computed).",
            ["adapter"],
            registry=r,
        )
        self.ttft = Histogram(
            PREFIX + "time_to_first_token_seconds",
            "Time from request arrival to its first generated token.",
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            PREFIX + "inter_token_latency_seconds",
            "Time between two consecutive generated tokens of a request.",
            buckets=ITL_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            PREFIX + "e2e_request_latency_seconds",
            "Time from request arrival to its last token.",
            buckets=E2E_BUCKETS,
            registry=r,
        )
        self.transfer = TransferMetrics(r, transfer_reasons) if transfer_reasons else None
        register_build_info(r)
        r.register(EngineCollector(snapshot, model_name))

    def admitted(self, adapter: str | None, prompt_tokens: int, cached_tokens: int) -> None:
        """A request's first token: its prompt, and what of it the cache served."""
        self.prompt_tokens.inc(prompt_tokens)
        self.prompt_tokens_cached.inc(cached_tokens)
        if adapter is not None:
            self.lora_requests.labels(adapter).inc()
            self.lora_prompt_tokens.labels(adapter).inc(prompt_tokens)
            self.lora_prompt_tokens_cached.labels(adapter).inc(cached_tokens)

    def forget_adapter(self, adapter: str) -> None:
        """The adapter was unloaded: its series go (a later load of the name starts them at 0)."""
        for counter in (self.lora_requests, self.lora_prompt_tokens, self.lora_prompt_tokens_cached):
            try:
                counter.remove(adapter)
            except KeyError:
                pass  # it served no request

    def render(self) -> bytes:
        return generate_latest(self.registry)
